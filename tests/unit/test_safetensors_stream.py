"""The streamed safetensors writer writes exactly the bytes safetensors writes, in any order."""

from __future__ import annotations

import random
import threading

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_engine import _safetensors

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


names = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
).filter(lambda n: n != "__metadata__")
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spec=st.dictionaries(names, st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=8),
    metadata=st.one_of(st.none(), st.just({"format": "pt"})),
    order_seed=st.integers(0, 2**16),
)
def test_bytes_equal_safetensors_in_any_write_order(tmp_path, spec, metadata, order_seed):
    tensors = {name: _tensor(dtype, shape, i) for i, (name, (dtype, shape)) in enumerate(spec.items())}
    reference = safetensors.torch.save(tensors, metadata=metadata)
    path = tmp_path / "streamed.safetensors"
    out = _safetensors.SafetensorsFile(
        path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], metadata
    )
    order = list(tensors)
    random.Random(order_seed).shuffle(order)
    for name in order:
        out.write(name, tensors[name])
    out.close()
    assert path.read_bytes() == reference
    assert out.nbytes == len(reference)


def test_save_file_matches_and_non_contiguous_tensors(tmp_path):
    tensors = {
        "w": torch.randn(4, 6).t(),
        "b": torch.arange(3.0),
        "e": torch.tensor(2.5, dtype=torch.bfloat16),
    }
    _safetensors.save_file(tensors, tmp_path / "a", {"format": "pt"})
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    assert (tmp_path / "a").read_bytes() == safetensors.torch.save(contiguous, metadata={"format": "pt"})
    loaded = safetensors.torch.load_file(tmp_path / "a")
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value)


def test_layout_mismatches_and_missing_tensors_are_errors(tmp_path):
    layout = [("a", torch.float32, (2, 3)), ("b", torch.int64, (4,))]
    out = _safetensors.SafetensorsFile(tmp_path / "f", layout)
    with pytest.raises(ValueError, match=r"'a'.*torch.float16.*torch.float32"):
        out.write("a", torch.zeros(2, 3, dtype=torch.float16))
    out.abort()

    out = _safetensors.SafetensorsFile(tmp_path / "g", layout)
    out.write("a", torch.zeros(2, 3))
    with pytest.raises(KeyError, match="'a'"):
        out.write("a", torch.zeros(2, 3))  # twice
    with pytest.raises(KeyError, match="'zz'"):
        out.write("zz", torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"never written: \['b'\]"):
        out.close()
    with pytest.raises(ValueError, match="duplicate"):
        _safetensors.SafetensorsFile(tmp_path / "h", [("a", torch.float32, (1,))] * 2)


def test_background_writer_keeps_one_job_in_flight_and_reports_the_first_error():
    running = []
    peak = []
    lock = threading.Lock()

    def job(i):
        with lock:
            running.append(i)
            peak.append(len(running))
        if i == 3:
            raise OSError("disk full (simulated)")
        with lock:
            running.remove(i)

    done = []
    writer = _safetensors.BackgroundWriter()
    for i in range(6):
        writer.submit(job, i)
        done.append(i)
    error = writer.close()
    assert isinstance(error, OSError) and "disk full" in str(error)
    assert max(peak) == 1  # never two jobs at once
    assert len(peak) == 4  # jobs after the failing one were skipped
    assert done == list(range(6))  # submitting after an error does not raise: the caller keeps going
