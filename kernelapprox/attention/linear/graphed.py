r"""Decoding under a captured CUDA graph: one step of `kernelapprox.RecurrentLinearAttention`
recorded once, then replayed for each token.

A decoding step is a few dozen small kernels on $F \times (d_v + 1)$ numbers per row; launched
one by one from Python, the host's launch time, not the device, sets its pace. A CUDA graph
records the launches of one step and replays them in one call (``torch.cuda.CUDAGraph``): the
step's inputs and its state then live at fixed addresses, the state is written in place
(``RecurrentLinearAttention(..., inplace=True)``), and the step reads no device value on the
host. `capture_step` is the recipe of ``torch.cuda.graphs`` (warm-up on a side stream, capture,
replay) for this step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._validation import check_bool, check_positive_int
from ..state import LinearAttentionState

__all__ = ["CapturedStep", "capture_step"]


class CapturedStep:
    """One decoding step recorded in a CUDA graph (`capture_step`), replayed by each call.

    Attributes
    ----------
    rnn : RecurrentLinearAttention
        The decoder whose state the graph advances in place (``rnn.state`` holds the same
        tensors after every call; ``rnn.steps`` counts the replays too).
    q_t, k_t, v_t : Tensor
        The static inputs the graph reads: a call copies its arguments into them.
    out : Tensor
        The static output the graph writes, returned by each call and overwritten by the next
        (clone it to keep it).
    graph : torch.cuda.CUDAGraph

    Examples
    --------
    Runs on a CUDA device (``docs/gpu.md``)::

        rnn = ka.RecurrentLinearAttention(fm, state=prefill_state)
        step = rnn.capture(q0, k0, v0)          # records one step; the state is unchanged
        for q_t, k_t, v_t in tokens:
            o_t = step(q_t, k_t, v_t)           # = rnn.step(q_t, k_t, v_t), replayed
    """

    def __init__(self, rnn: Any, graph: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 out: torch.Tensor) -> None:
        self.rnn = rnn
        self.graph = graph
        self.q_t, self.k_t, self.v_t = inputs
        self.out = out

    def __call__(self, q_t: torch.Tensor | None = None, k_t: torch.Tensor | None = None,
                 v_t: torch.Tensor | None = None) -> torch.Tensor:
        """One step on ``q_t, k_t, v_t`` (copied into the static inputs; ``None``: the static
        input as it is, e.g. written there by the caller). Returns `out`."""
        for name, given, static in (("q_t", q_t, self.q_t), ("k_t", k_t, self.k_t), ("v_t", v_t, self.v_t)):
            if given is None or given is static:
                continue
            if given.shape != static.shape:
                raise ValueError(f"{name} must have the captured shape {tuple(static.shape)}, got {tuple(given.shape)}")
            static.copy_(given)
        self.graph.replay()
        self.rnn.steps += 1
        return self.out


def capture_step(
    rnn: Any,
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    *,
    warmup: int = 2,
    compile: bool = False,
) -> CapturedStep:
    r"""Record one decoding step of ``rnn`` in a CUDA graph; the state is left as it was.

    The recipe of ``torch.cuda.graphs``: (1) a padded token, which leaves the state's content
    unchanged, brings the state to the step's own layout (per-feature log-scales for gated
    maps) and storage, with ``rnn.inplace`` set; (2) ``warmup`` steps on a side stream (cuBLAS
    workspaces, Triton's autotuning and, with ``compile``, the compilation), after which the
    state is restored; (3) the capture of one step. The path captured is the one
    `kernelapprox.backends.decode_plan` chooses (fla's fused recurrent kernel where available).

    Parameters
    ----------
    rnn : RecurrentLinearAttention
        A decoder with a state (after the prompt, or after one eager step).
    q_t, k_t : Tensor, shape (..., d)
        A token of the shapes to replay (CUDA tensors; its values do not matter).
    v_t : Tensor, shape (..., dv)
    warmup : int, default 2
        Steps before the capture (at least 3 with ``compile``: the first calls compile, and the
        step counter becomes a dynamic integer after one recompilation).
    compile : bool, default False
        Capture ``torch.compile(rnn.step)`` (Inductor fuses the step's pointwise kernels: fewer
        launches per replay) instead of the eager step.

    Returns
    -------
    CapturedStep

    Examples
    --------
    Runs on a CUDA device; see `CapturedStep`.
    """
    check_positive_int("warmup", warmup)
    check_bool("compile", compile)
    for name, t in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            got = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a CUDA tensor to capture a CUDA graph, got {got}")
    if rnn.state is None:
        raise ValueError("rnn has no state: run the prompt (or one step) before capturing the decoding step")
    device = q_t.device
    steps = rnn.steps
    rnn.inplace = True
    qs, ks, vs = (t.detach().clone() for t in (q_t, k_t, v_t))
    pad = torch.ones(ks.shape[:-1], dtype=torch.bool, device=device)
    # default dynamism: the shapes never change, and the step counter turns into a dynamic integer
    # after one recompilation (``dynamic=False`` would recompile at every token)
    fn: Callable[..., torch.Tensor] = torch.compile(rnn.step) if compile else rnn.step
    if compile:
        warmup = max(warmup, 3)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad(), torch.cuda.stream(side):
        rnn.step(qs, ks, vs, key_padding_mask=pad)  # the step's layout, in tensors of its own
        kept = LinearAttentionState(rnn.state.kv.clone(), rnn.state.log_scale.clone())
        for _ in range(warmup):
            fn(qs, ks, vs)
        rnn.state.kv.copy_(kept.kv)
        rnn.state.log_scale.copy_(kept.log_scale)
    torch.cuda.current_stream(device).wait_stream(side)
    kv, log_scale = rnn.state.kv, rnn.state.log_scale
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fn(qs, ks, vs)
    rnn.steps = steps
    if rnn.state.kv is not kv or rnn.state.log_scale is not log_scale:
        raise RuntimeError("the step replaced its state instead of writing it in place: it cannot be replayed")
    return CapturedStep(rnn, graph, (qs, ks, vs), out)
