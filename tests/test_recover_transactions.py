"""kernelapprox.recover under faults: load and save are all or nothing, and wrong arguments are
refused before anything changes, naming what is wrong.

* a file that does not fit the handle (other map width, other layers) is refused before the model
  changes, and a retry with the right file then works;
* ``finetune`` / ``transfer`` with a teacher of another width are refused before adapters are
  injected, naming the teacher;
* ``save`` of a restored handle is refused; an interrupted ``save`` leaves the previous file whole;
* a truncated checkpoint's error names the file; a fully padded row names ``attention_mask``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from kernelapprox import hf, recover  # noqa: E402

VOCAB, N_SEQ, N_TOK = 99, 6, 12


def tiny(seed: int = 0, hidden: int = 32):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    return BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                vocab_size=VOCAB, initializer_range=0.2)).eval()


def ids(seed: int, n_seq: int = N_SEQ) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (n_seq, N_TOK), generator=torch.Generator().manual_seed(seed))}


def linearised(seed: int = 0, num_features: int = 8, **kw):
    model = tiny(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = hf.linearize(model, "hedgehog", num_features=num_features, calibration=ids(1), fit_steps=1, **kw)
    return model, lin


@pytest.fixture
def made():
    """Every handle a test builds is restored at its end (the switch is global in transformers)."""
    handles: list[hf.Linearized] = []
    yield handles
    for lin in handles:
        recover.unload(lin)  # removes unmerged adapters, then restores


def snapshot(model) -> tuple[dict[str, torch.Tensor], list[str], dict[str, bool]]:
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, [n for n, _ in model.named_modules()],
            {n: p.requires_grad for n, p in model.named_parameters()})


def assert_untouched(model, snap) -> None:
    state, names, flags = snap
    now = model.state_dict()
    assert list(now) == list(state)
    assert all(torch.equal(now[k], v) for k, v in state.items())
    assert [n for n, _ in model.named_modules()] == names
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def outputs(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).last_hidden_state


@pytest.mark.parametrize("wrong", ["width", "layers"])
def test_a_file_that_does_not_fit_changes_nothing_and_a_retry_works(tmp_path, made, wrong):
    model, lin = linearised(0)
    made.append(lin)
    teacher = copy.deepcopy(tiny(0))
    recover.finetune(lin, teacher, ids(1), targets=["value"], steps=2, batch_size=3, progress=False)
    recover.save(lin, tmp_path / "good.pt")
    other_model, other = linearised(3, num_features=4) if wrong == "width" else linearised(3, layers=[1])
    made.append(other)
    recover.finetune(other, copy.deepcopy(tiny(3)), ids(1), targets=["value"], steps=1, batch_size=3,
                     progress=False)
    recover.save(other, tmp_path / "bad.pt")

    fresh, lin2 = linearised(7)
    made.append(lin2)
    snap = snapshot(fresh)
    maps = {layer: copy.deepcopy(fm.state_dict()) for layer, fm in lin2.feature_maps.items()}
    with pytest.raises(ValueError, match="bad.pt"):
        recover.load(lin2, tmp_path / "bad.pt")
    assert_untouched(fresh, snap)
    for layer, fm in lin2.feature_maps.items():
        assert all(torch.equal(fm.state_dict()[k], v) for k, v in maps[layer].items())
    assert recover.load(lin2, tmp_path / "good.pt") is fresh  # the retry is not refused
    ev = ids(2, 3)
    assert torch.equal(outputs(fresh, ev), outputs(model, ev))


def test_a_map_of_another_kind_is_refused_before_loading(tmp_path, made):
    _, lin = linearised(0)
    made.append(lin)
    recover.save(lin, tmp_path / "fla.pt")
    fresh = tiny(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin2 = hf.linearize(fresh, "hedgehog-lolcats", num_features=8, calibration=ids(1), fit_steps=1)
    made.append(lin2)
    snap = snapshot(fresh)
    with pytest.raises(ValueError, match="variant"):
        recover.load(lin2, tmp_path / "fla.pt")
    assert_untouched(fresh, snap)


@pytest.mark.parametrize("stage", ["finetune", "transfer"])
def test_a_teacher_of_another_width_is_refused_before_adapters(made, stage):
    model, lin = linearised(0)
    made.append(lin)
    snap = snapshot(model)
    narrow = tiny(0, hidden=16)
    call = recover.finetune if stage == "finetune" else recover.transfer
    with pytest.raises(ValueError, match=r"^teacher has hidden_size=16"):
        call(lin, narrow, ids(1), steps=1, batch_size=3, progress=False)
    assert_untouched(model, snap)
    assert not any("lora" in n for n, _ in model.named_modules())
    recover.finetune(lin, copy.deepcopy(tiny(0)), ids(1), targets=["value"], steps=1, batch_size=3, progress=False)


def test_save_of_a_restored_handle_is_refused(tmp_path, made):
    _, lin = linearised(0)
    lin.restore()
    with pytest.raises(ValueError, match="active"):
        recover.save(lin, tmp_path / "x.pt")
    assert not list(tmp_path.iterdir())


def test_an_interrupted_save_leaves_the_previous_file_whole(tmp_path, made, monkeypatch):
    model, lin = linearised(0)
    made.append(lin)
    path = tmp_path / "lin.pt"
    recover.save(lin, path)
    before = path.read_bytes()
    real_save = torch.save

    def interrupted(obj, f, *a, **kw):
        real_save({"format": "partial"}, f)  # some bytes reach the file, then the process is stopped
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        recover.save(lin, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["lin.pt"]  # no temporary file left behind
    fresh, lin2 = linearised(7)
    made.append(lin2)
    recover.load(lin2, path)
    ev = ids(2, 3)
    assert torch.equal(outputs(fresh, ev), outputs(model, ev))


def test_a_truncated_checkpoint_names_the_file(tmp_path, made):
    _, lin = linearised(0)
    made.append(lin)
    path = tmp_path / "cut.pt"
    recover.save(lin, path)
    path.write_bytes(path.read_bytes()[:595])
    fresh, lin2 = linearised(7)
    made.append(lin2)
    snap = snapshot(fresh)
    with pytest.raises(ValueError, match="cut.pt"):
        recover.load(lin2, path)
    assert_untouched(fresh, snap)


def test_a_fully_padded_row_names_attention_mask(made):
    _, lin = linearised(0)
    made.append(lin)
    inputs = ids(1)
    mask = torch.ones_like(inputs["input_ids"])
    mask[2] = 0
    with pytest.raises(ValueError, match=r"attention_mask.*\[2\]"):
        recover.transfer(lin, copy.deepcopy(tiny(0)), {**inputs, "attention_mask": mask}, steps=1, batch_size=3,
                         progress=False)
