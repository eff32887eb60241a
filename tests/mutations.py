"""Mutation check: plant small, realistic bugs in a copy of the repository and show the suite going red.

Run from the repository root::

    python -m tests.mutations                      # control + every mutant, pytest -n 2
    python -m tests.mutations --list               # the mutants, one line each
    python -m tests.mutations --only causal-mask-off-by-one --only qr-sign-dropped
    python -m tests.mutations --jobs 4 --markdown /tmp/mutations.md
    python -m tests.mutations --pytest-args "-m 'not slow'"   # passed through to every pytest run

How it works. The working tree is never touched. The tracked and untracked-but-not-ignored files
(``git ls-files --cached --others --exclude-standard``) are copied once into a snapshot under a fresh
temporary directory, so that every run sees the same sources even while others edit the tree. The
unmutated snapshot is tested first (the *control*); it must be green, else the check aborts (a red
control makes the table meaningless). Then, for each mutant, the snapshot is copied again, the
mutation is applied there as an exact string replacement that must match exactly once (anything
else aborts loudly), and ``python -m pytest -n JOBS -p no:cacheprovider -q -rfE`` runs in that
copy. ``tests/test_mutations.py`` (the static check of this list) and this file are ignored in
those runs: the former would fail on *every* mutant, since the mutated target no longer occurs.

Which ``kernelapprox`` is imported. ``PYTHONPATH`` starts with the copy, and the copy is pytest's
working directory. The editable install of the main checkout is a finder *appended* to
``sys.meta_path``, after the ordinary path finder, so the copy wins; this is not assumed but checked
twice per run: (1) ``python -c "import kernelapprox, studies; ..."`` in the copy must report files
inside it, and (2) a small pytest plugin (``-p _mutation_probe``, written outside the copy) records,
in the controller and in every xdist worker at session end, the file of every loaded
``kernelapprox*``/``studies*`` module; any file outside the copy, or no record of ``kernelapprox`` at
all, aborts the check. The same plugin records the failing test ids (controller-side reports only,
so xdist does not count them twice), including collection errors.

A mutant is *caught* when at least one test fails or errors; *survived* when pytest exits 0. A run
that ends otherwise (timeout, pytest usage error) is reported as an error.

Exit status: 0 if every selected mutant was caught, 1 if one survived or errored, 2 if the control
was red or the setup failed.

Cost: one pytest run per mutant plus the control, each about as long as the suite itself (about
1300 tests). Measured on the 2-core development machine with ``-n 2``: a full check (control + 13
mutants) took 72 minutes while other pytest runs shared the two cores (control 7 min, mutants 4-6
min each); on an idle machine expect roughly half. Use ``--only`` (and ``--pytest-args`` with a
subset of test files) while iterating.

Known equivalent mutant. ``trig-offset-half-range`` does not change any kernel estimate:
``cos(a + b) cos(c + b)`` has period ``pi`` in ``b``, so phases on ``[0, pi)`` give
exactly the law of ``b mod pi`` for ``b ~ U[0, 2 pi)``; only the features themselves change
(``E phi(x)_i != 0``). Only a test of the law of ``fm.offsets`` (or of the mean of single
features) can catch it: it survived the first run of this check, before
``tests/test_modules.py::test_offset_phases_are_uniform_on_the_full_circle`` was added.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Files ignored in every pytest run of the check (see the module docstring).
IGNORED_IN_RUNS = ("tests/test_mutations.py", "tests/mutations.py")


@dataclass(frozen=True)
class Mutant:
    """One planted bug: replace ``old`` by ``new`` in ``path`` (relative to the repository root)."""

    name: str
    path: str
    old: str
    new: str
    description: str

    def apply(self, root: Path) -> None:
        """Apply the mutation to the copy at ``root``; raise unless ``old`` occurs exactly once."""
        target = root / self.path
        text = target.read_text(encoding="utf-8")
        count = text.count(self.old)
        if count != 1:
            raise MutationError(
                f"mutant {self.name!r}: the target string occurs {count} times in {self.path} "
                f"(expected exactly once); update tests/mutations.py\n  target: {self.old!r}"
            )
        target.write_text(text.replace(self.old, self.new, 1), encoding="utf-8")


class MutationError(RuntimeError):
    """A mutation could not be applied, or a run could not be trusted."""


_E = "kernelapprox/maps/exponential.py"
_T = "kernelapprox/maps/trig.py"
_D = "kernelapprox/maps/deterministic.py"
_S = "kernelapprox/samplers.py"
_M = "kernelapprox/theory/exponential.py"

MUTANTS: tuple[Mutant, ...] = (
    # 1. a 1% scale error in the kernel estimate of each registered estimator (forward,
    #    log_features and kernel all see it; attention does not, the factor cancels there)
    Mutant(
        "scale-positive", _E,
        "return -_sqnorm_half(xc, low) - 0.5 * math.log(self.num_features)",
        "return -_sqnorm_half(xc, low) - 0.5 * math.log(self.num_features / 1.01)",
        "PositiveRF: 1/sqrt(r) normalisation computed with r/1.01, kernel 1% too large",
    ),
    Mutant(
        "scale-hyperbolic", _E,
        "return -_sqnorm_half(xc, low) - 0.5 * math.log(2 * self.num_features)",
        "return -_sqnorm_half(xc, low) - 0.5 * math.log(2 * self.num_features / 1.01)",
        "HyperbolicRF: 1/sqrt(2r) normalisation computed with 2r/1.01, kernel 1% too large",
    ),
    Mutant(
        "scale-trig-sincos", _T,
        'log_c = -0.5 * math.log(r) if self.variant == "sincos"',
        'log_c = -0.5 * math.log(r / 1.01) if self.variant == "sincos"',
        "TrigRF sincos: 1/sqrt(r) normalisation computed with r/1.01, kernel 1% too large",
    ),
    Mutant(
        "scale-trig-offset", _T,
        'if self.variant == "sincos" else 0.5 * math.log(2.0 / r)',
        'if self.variant == "sincos" else 0.5 * math.log(2.02 / r)',
        "TrigRF offset: sqrt(2/r) written sqrt(2.02/r), kernel 1% too large",
    ),
    Mutant(
        "scale-elu", _D,
        "return torch.where(xc >= 0, xc + 1, torch.exp(torch.clamp(xc, max=0)))",
        "return math.sqrt(1.01) * torch.where(xc >= 0, xc + 1, torch.exp(torch.clamp(xc, max=0)))",
        "EluFeatures: features scaled by sqrt(1.01), kernel 1% too large",
    ),
    Mutant(
        "scale-relu", _D,
        "return torch.relu(xc)",
        "return math.sqrt(1.01) * torch.relu(xc)",
        "ReluFeatures: features scaled by sqrt(1.01), kernel 1% too large",
    ),
    # 2. Haar sampler without the QR sign correction
    Mutant(
        "qr-sign-dropped", _S,
        "return Q * sign.unsqueeze(-2)",
        "return Q",
        "haar_orthogonal returns Q without the diag(sign R_ii) correction",
    ),
    # 3. chi norms silently replaced by the fixed norm sqrt(d)
    Mutant(
        "chi-norms-fixed", _S,
        'norms = torch.randn(*B, r, d, generator=generator, dtype=torch.float64, device="cpu").norm(dim=-1)',
        'norms = torch.full((*B, r), math.sqrt(d), dtype=torch.float64, device="cpu")',
        'OrthogonalSampler(norms="chi") scales rows to sqrt(d) instead of chi_d draws',
    ),
    # 4. causal mask off by one inside a chunk (the one mask of the intra-chunk product)
    Mutant(
        "causal-mask-off-by-one", "kernelapprox/attention/linear/chunk.py",
        "mask = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril()",
        "mask = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril(1)",
        "chunked causal form: token i sees token i+1 of its chunk (.tril() -> .tril(1))",
    ),
    # 5. trig offset phases on half the range
    Mutant(
        "trig-offset-half-range", _T,
        "b = (2 * math.pi * b).to(device=device, dtype=self._buffer_dtype())",
        "b = (math.pi * b).to(device=device, dtype=self._buffer_dtype())",
        "TrigRF offset phases b ~ U[0, pi) instead of U[0, 2 pi) (kernel law unchanged: see docstring)",
    ),
    # 6. a 5% error in one closed-form MSE: the per-projection variance, and the ORF pair covariance
    Mutant(
        "mse-v1-positive-5pct", _M,
        "v1 = 0.5 * np.expm1(-t) ** 2 if hyperbolic else -np.expm1(-t)",
        "v1 = 0.5 * np.expm1(-t) ** 2 if hyperbolic else -1.05 * np.expm1(-t)",
        "theory: per-projection variance v1 of positive features (iid and chi ORF) 5% too large",
    ),
    Mutant(
        "mse-cv-orf-5pct", _M,
        "cv[small] = _pair_excess(d, 0.5 * t[small]) * np.exp(-2.0 * t[small])",
        "cv[small] = 1.05 * _pair_excess(d, 0.5 * t[small]) * np.exp(-2.0 * t[small])",
        "theory: chi-ORF pair covariance cv of positive/hyperbolic features 5% off (t <= 70)",
    ),
    # 7. linear attention returns the numerator only
    Mutant(
        "normaliser-dropped", "kernelapprox/attention/_common.py",
        "return num / den",
        "return num",
        "shared normalisation of linear attention returns num instead of num / den",
    ),
    # 8. the stronger estimators (FAVOR++, FAVOR#, simplex, hybrid): the published defects
    Mutant(
        "sderf-constant-D-dropped", "kernelapprox/maps/dense_exponential.py",
        "logc = 0.25 * torch.log(one4).sum(-1) - 0.5 * math.log(self.num_features)",
        "logc = 0.0 * torch.log(one4).sum(-1) - 0.5 * math.log(self.num_features)",
        "SDERF without D = prod(1 - 4A_l)^(1/4), as the reference expsharp_: raw kernel biased by 1/D^2",
    ),
    Mutant(
        "saderf-reciprocal-scaling", "kernelapprox/maps/dense_exponential.py",
        "psi = ratio ** 0.25",
        "psi = ratio ** -0.25",
        "SADERF with the reference exparf_'s reciprocal scaling (unbiased, but worse than no scaling)",
    ),
    Mutant(
        "hybrid-weights-reversed", "kernelapprox/maps/hybrid.py",
        "wa, wb = lam, 1 - lam",
        "wa, wb = 1 - lam, lam",
        "hybrid kernel with the official notebook's assignment (theta/pi on the trig part)",
    ),
    Mutant(
        "simplex-wrong-scale", _S,
        "math.sqrt(d / (d - 1)) * torch.eye(d, dtype=torch.float64)[: d - 1]",
        "math.sqrt((d - 1) / d) * torch.eye(d, dtype=torch.float64)[: d - 1]",
        "simplex vectors built with sqrt((d-1)/d) for sqrt(d/(d-1)): not unit, not a simplex",
    ),
    Mutant(
        "oprf-A-scaled", "kernelapprox/maps/dense_exponential.py",
        "a = A.to(xc.dtype)[..., None] * wn2  # A |w_i|^2",
        "a = 0.98 * A.to(xc.dtype)[..., None] * wn2  # A |w_i|^2",
        "OPRF's quadratic term with 0.98 A: the features no longer match their constant D (biased kernel)",
    ),
    Mutant(
        "recover-adapters-on-key", "kernelapprox/recover/finetune.py",
        '"value": "attention.self.value", "output": "attention.output.dense"},',
        '"value": "attention.self.key", "output": "attention.output.dense"},',
        "LoRA adapters for BERT's value projection placed on the key projection",
    ),
    Mutant(
        "recover-student-inputs", "kernelapprox/recover/transfer.py",
        "data = _teacher_layers(teacher, inputs_, list(maps), exact)",
        "data = _teacher_layers(lin.model, inputs_, list(maps), exact)",
        "attention transfer trained on the linearised model's own q, k, v and outputs, not the teacher's",
    ),
    Mutant(
        "dlogd-tail-undivided", "studies/dlogd.py",
        "np.where(decays, g2 * rho / (1 - rho), np.nan)",
        "np.where(decays, g2 * rho, np.nan)",
        "dlogd's extrapolated search tail g2*rho instead of the geometric sum g2*rho/(1-rho)",
    ),
    Mutant(
        "dlogd-bias-not-squared", "studies/dlogd.py",
        '"corr_log": 2 * math.log1p(b)',
        '"corr_log": math.log1p(b)',
        "dlogd's search-bias correction of log r* without the square (r* is proportional to sup^2)",
    ),
    Mutant(
        "dlogd-growth-margin-full", "studies/dlogd.py",
        "half = 0.5 * math.log(dlnd_growth(d0, d1))",
        "half = math.log(dlnd_growth(d0, d1))",
        "dlogd's growth verdict with the margin reaching d·ln d's prediction instead of half way "
        "(d·ln d data can no longer differ)",
    ),
    Mutant(
        "hybrid-lost-rows-kept", "kernelapprox/attention/hybrid/rescue.py",
        'return res.masked_fill(lost.unsqueeze(-1), float("nan"))',
        "return res",
        "hybrid attention without a host read returns the rows it cannot resolve as computed, not NaN",
    ),
)

_PROBE = textwrap.dedent(
    '''
    """pytest plugin of tests/mutations.py: records failures and where kernelapprox was imported from."""
    import json
    import os
    import sys

    _OUT = os.environ["KA_MUTATION_PROBE_OUT"]
    _config = None


    def _write(rec):
        with open(_OUT, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\\n")


    def _is_worker():
        return _config is not None and hasattr(_config, "workerinput")


    def pytest_configure(config):
        global _config
        _config = config


    def pytest_collectreport(report):
        if report.failed and not _is_worker():
            _write({"kind": "failure", "nodeid": report.nodeid or "<collection>", "when": "collect"})


    def pytest_runtest_logreport(report):
        if report.failed and not _is_worker():
            _write({"kind": "failure", "nodeid": report.nodeid, "when": report.when})


    def pytest_sessionfinish(session, exitstatus):
        files = {}
        for name, mod in list(sys.modules.items()):
            top = name.split(".")[0]
            if top in ("kernelapprox", "studies"):
                files[name] = getattr(mod, "__file__", None)
        worker = _config.workerinput.get("workerid") if _is_worker() else "controller"
        _write({"kind": "modules", "process": worker, "pid": os.getpid(), "files": files})
    '''
)

_IMPORT_CHECK = (
    "import json, kernelapprox, studies; "
    "print(json.dumps([kernelapprox.__file__, studies.__file__]))"
)


@dataclass
class RunResult:
    name: str
    returncode: int | None
    seconds: float
    failures: list[str] = field(default_factory=list)
    log: str = ""
    timed_out: bool = False

    @property
    def verdict(self) -> str:
        if self.timed_out:
            return "ERROR (timeout)"
        if self.returncode == 0:
            return "survived"
        if self.failures:
            return "caught"
        return f"ERROR (pytest exit {self.returncode}, no failing test recorded)"


def _source_files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo, capture_output=True, check=True,
    ).stdout.decode("utf-8")
    return sorted({p for p in out.split("\0") if p})


def snapshot(repo: Path, dest: Path) -> int:
    """Copy the tracked and untracked-but-not-ignored files of ``repo`` into ``dest``; returns the count."""
    n = 0
    for rel in _source_files(repo):
        src = repo / rel
        if not src.is_file():  # tracked but deleted in the working tree, or a submodule
            continue
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=True)
        n += 1
    return n


def _env(copy: Path, probe_dir: Path, probe_out: Path) -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(copy), str(probe_dir)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["KA_MUTATION_PROBE_OUT"] = str(probe_out)
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTHONSAFEPATH", None)
    return env


def _inside(path: str | None, root: Path) -> bool:
    if path is None:
        return True  # namespace packages and the like carry no file
    try:
        Path(path).resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def check_import_location(copy: Path, env: dict[str, str]) -> list[str]:
    """``kernelapprox.__file__`` and ``studies.__file__`` as imported in ``copy``; raise if outside it."""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK], cwd=copy, env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise MutationError(f"importing kernelapprox in the copy failed:\n{out.stderr}")
    files = json.loads(out.stdout.strip().splitlines()[-1])
    bad = [f for f in files if not _inside(f, copy)]
    if bad:
        raise MutationError(f"the copy at {copy} imports code from outside it: {bad}")
    return files


def _read_probe(probe_out: Path, copy: Path) -> list[str]:
    """Failing node ids recorded by the probe; raise if a module came from outside ``copy``."""
    failures: list[str] = []
    saw_kernelapprox = False
    if not probe_out.exists():
        return failures
    for line in probe_out.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec["kind"] == "failure":
            nid = rec["nodeid"] + ("" if rec["when"] == "call" else f" ({rec['when']})")
            if nid not in failures:
                failures.append(nid)
        elif rec["kind"] == "modules":
            outside = {k: v for k, v in rec["files"].items() if not _inside(v, copy)}
            if outside:
                raise MutationError(
                    f"pytest process {rec['process']} imported modules from outside the copy {copy}: {outside}"
                )
            saw_kernelapprox |= "kernelapprox" in rec["files"]
    if not saw_kernelapprox:
        raise MutationError("no pytest process recorded an imported kernelapprox: the probe did not run")
    return sorted(failures)


def run_pytest(
    name: str,
    copy: Path,
    probe_dir: Path,
    jobs: int,
    extra: list[str],
    timeout: float,
    log_dir: Path | None,
) -> RunResult:
    probe_out = copy.parent / f"{copy.name}.probe.jsonl"
    env = _env(copy, probe_dir, probe_out)
    check_import_location(copy, env)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "_mutation_probe", "-q", "-rfE"]
    if jobs > 0:
        cmd += ["-n", str(jobs)]
    cmd += [f"--ignore={p}" for p in IGNORED_IN_RUNS]
    cmd += extra
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the group of the pytest run started just above
        log, _ = proc.communicate()
    seconds = time.monotonic() - t0
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{name}.log").write_text(log, encoding="utf-8")
    failures = _read_probe(probe_out, copy)
    return RunResult(name, proc.returncode, seconds, failures, log, timed_out)


def _ids_cell(failures: list[str], first: int) -> str:
    if not failures:
        return "-"
    shown = ", ".join(failures[:first])
    more = len(failures) - first
    return f"({len(failures)}) {shown}" + (f", ... (+{more})" if more > 0 else "")


def markdown_table(
    results: list[RunResult], mutants: dict[str, Mutant], control: RunResult, header: str, first: int
) -> str:
    lines = [
        "# Mutation check",
        "",
        header,
        "",
        f"Control (unmutated copy): **{'green' if control.returncode == 0 else 'RED'}** "
        f"in {control.seconds:.0f} s.",
        "",
        "| mutant | file | bug | verdict | tests that caught it (count, first ids) | time |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        m = mutants[r.name]
        ids = _ids_cell(r.failures, first).replace("|", "\\|")
        lines.append(
            f"| `{m.name}` | `{m.path}` | {m.description} | **{r.verdict}** | {ids} | {r.seconds:.0f} s |"
        )
    caught = sum(r.verdict == "caught" for r in results)
    lines += ["", f"{caught}/{len(results)} mutants caught.", ""]
    return "\n".join(lines)


def _repo_state(repo: Path) -> str:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "diff", "--quiet", "HEAD"], cwd=repo, capture_output=True, check=False
    ).returncode
    return f"{head or 'no commit'}{' + uncommitted changes' if dirty else ''}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.mutations", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--jobs", type=int, default=2, help="pytest -n value (0: no xdist); default 2")
    ap.add_argument("--markdown", type=Path, metavar="PATH", help="write the result table as markdown")
    ap.add_argument("--pytest-args", default="", metavar="ARGS",
                    help="extra pytest arguments (one shell-quoted string), passed to every run")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run; default 1800")
    ap.add_argument("--first", type=int, default=3, help="failing test ids shown per mutant; default 3")
    ap.add_argument("--log-dir", type=Path, metavar="DIR", help="keep each run's pytest output in DIR")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies (their path is printed)")
    args = ap.parse_args(argv)

    by_name = {m.name: m for m in MUTANTS}
    if args.list:
        width = max(len(n) for n in by_name)
        for m in MUTANTS:
            print(f"{m.name:<{width}}  {m.path}: {m.description}")
        return 0
    selected = list(MUTANTS)
    if args.only:
        unknown = [n for n in args.only if n not in by_name]
        if unknown:
            ap.error(f"unknown mutant(s) {unknown}; see --list")
        selected = [by_name[n] for n in dict.fromkeys(args.only)]
    extra = shlex.split(args.pytest_args)

    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="ka-mutations-"))
    try:
        probe_dir = tmp / "probe"
        probe_dir.mkdir()
        (probe_dir / "_mutation_probe.py").write_text(_PROBE, encoding="utf-8")
        base = tmp / "snapshot"
        n_files = snapshot(REPO_ROOT, base)
        state = _repo_state(REPO_ROOT)
        print(f"snapshot: {n_files} files of {REPO_ROOT} ({state}) -> {base}", flush=True)
        for m in selected:  # fail loudly before any run if a target string has rotted
            m.apply(_scratch_copy(base, tmp / f"dry-{m.name}", m.path))

        control_dir = tmp / "control"
        shutil.copytree(base, control_dir)
        files = check_import_location(control_dir, _env(control_dir, probe_dir, tmp / "unused"))
        print(f"import check: kernelapprox -> {files[0]}", flush=True)
        print("control: running the suite on the unmutated copy ...", flush=True)
        control = run_pytest("control", control_dir, probe_dir, args.jobs, extra, args.timeout, args.log_dir)
        print(f"control: exit {control.returncode}, {len(control.failures)} failing, {control.seconds:.0f} s",
              flush=True)
        if control.returncode != 0:
            print(control.log[-6000:], file=sys.stderr)
            print("ABORT: the control run is red; a mutation table would be meaningless.", file=sys.stderr)
            return 2
        if not args.keep:
            shutil.rmtree(control_dir, ignore_errors=True)

        results: list[RunResult] = []
        for i, m in enumerate(selected, 1):
            copy = tmp / f"m-{m.name}"
            shutil.copytree(base, copy)
            m.apply(copy)
            print(f"[{i}/{len(selected)}] {m.name}: {m.description} ...", flush=True)
            res = run_pytest(m.name, copy, probe_dir, args.jobs, extra, args.timeout, args.log_dir)
            results.append(res)
            print(f"    -> {res.verdict}: {_ids_cell(res.failures, args.first)} ({res.seconds:.0f} s)",
                  flush=True)
            if res.verdict.startswith("ERROR"):
                print(textwrap.indent(res.log[-3000:], "    | "), flush=True)
            if not args.keep:
                shutil.rmtree(copy, ignore_errors=True)

        total = time.monotonic() - t_start
        header = (
            f"Sources: {state}, {n_files} files. pytest `-n {args.jobs}`"
            + (f" `{args.pytest_args}`" if args.pytest_args else "")
            + f". Total wall time {total / 60:.1f} min."
        )
        md = markdown_table(results, by_name, control, header, args.first)
        print()
        width = max(len(r.name) for r in results) if results else 0
        for r in results:
            print(f"{r.name:<{width}} -> {r.verdict:<9} -> {_ids_cell(r.failures, args.first)}")
        print(f"\n{sum(r.verdict == 'caught' for r in results)}/{len(results)} caught; "
              f"control green in {control.seconds:.0f} s; total {total / 60:.1f} min")
        if args.markdown:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(md, encoding="utf-8")
            print(f"markdown table written to {args.markdown}")
        return 0 if all(r.verdict == "caught" for r in results) else 1
    except MutationError as e:
        print(f"ABORT: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"temporary copies kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _scratch_copy(base: Path, dest: Path, rel: str) -> Path:
    """A copy of the single file ``rel`` of ``base`` under ``dest`` (for a dry run of a mutation)."""
    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(base / rel, dest / rel)
    return dest


if __name__ == "__main__":
    sys.exit(main())
