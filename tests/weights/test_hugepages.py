"""The matrices a decode step streams are copied from the mapped weight cache into huge pages."""
import mmap

import numpy as np
import pytest

from appliance import Engine
from appliance.weights import hugepages

needs_thp = pytest.mark.skipif(not hugepages.wanted(), reason="no transparent huge pages on this kernel")


def _region(address: int) -> tuple[str, str]:
    """(the /proc/self/maps line, its VmFlags) of the mapping holding `address`."""
    line = None
    with open("/proc/self/smaps") as f:
        for row in f:
            head = row.split()[0]
            if "-" in head and not row.startswith("VmFlags"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                line = row.strip() if lo <= address < hi else None
            elif line is not None and row.startswith("VmFlags"):
                return line, row.split(":", 1)[1]
    raise AssertionError(f"no mapping holds {address:#x}")


def _in_cache_file(a: np.ndarray) -> bool:
    return "/.appliance-cache/" in _region(a.ctypes.data)[0]


@needs_thp
def test_an_arena_is_aligned_and_advised_for_huge_pages():
    a = hugepages.arena(3 << 20)
    assert a.dtype == np.uint8 and a.size == 3 << 20 and a.flags.writeable
    assert a.ctypes.data % hugepages.HUGE_PAGE == 0
    assert " hg" in _region(a.ctypes.data)[1]                     # MADV_HUGEPAGE took
    assert not hugepages.is_mapped(a)
    with pytest.raises(ValueError, match="not a read-only view"):
        hugepages.release(a)                                       # would zero this memory


def test_release_drops_a_mapped_range_and_keeps_its_bytes(tmp_path):
    path = tmp_path / "blob"
    data = np.random.default_rng(0).integers(0, 255, 64 * mmap.PAGESIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(m, np.uint8)[100:-100]
    assert view.sum() > 0                                          # every page mapped in
    hugepages.release(view)
    assert np.array_equal(view, data[100:-100])                    # read again from the page cache


def test_the_switch_and_the_kernel_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("APPLIANCE_WEIGHT_HUGEPAGES", "0")
    assert not hugepages.wanted()
    monkeypatch.setenv("APPLIANCE_WEIGHT_HUGEPAGES", "1")
    for setting, want in (("always [madvise] never", True), ("[always] madvise never", True),
                          ("always madvise [never]", False)):
        (tmp_path / "enabled").write_text(setting + "\n")
        monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "enabled")
        assert hugepages.wanted() is want
    monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "missing")
    assert not hugepages.wanted()
    monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "enabled")
    (tmp_path / "enabled").write_text("always [madvise] never\n")

    class Refused(mmap.mmap):          # as under a seccomp filter that refuses madvise
        def madvise(self, *args):
            raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(hugepages.mmap, "mmap", Refused)
    assert not hugepages.wanted()


@needs_thp
def test_an_engine_streams_from_huge_pages_with_the_same_logits(monkeypatch, tiny_qwen3_dir):
    ids = list(range(3, 40))
    monkeypatch.setenv("APPLIANCE_WEIGHT_HUGEPAGES", "0")
    mapped = Engine.load(tiny_qwen3_dir, weights="q8", progress=False)      # writes the cache
    monkeypatch.setenv("APPLIANCE_WEIGHT_HUGEPAGES", "1")
    huge = Engine.load(tiny_qwen3_dir, weights="q8", progress=False)
    streamed = huge.model.streamed_linears()
    assert len(streamed) == 4 * huge.config.num_hidden_layers + 1
    arrays = [a for lin in streamed for a in (lin.ws, lin.qs, lin.d) if a is not None]
    assert huge.weight_cache.hugepage_bytes == sum(a.nbytes for a in arrays) > 0
    regions = {_region(a.ctypes.data) for a in arrays}
    assert len(regions) == 1                                       # one arena for all of them
    assert "/.appliance-cache/" not in next(iter(regions))[0] and " hg" in next(iter(regions))[1]
    assert all(a.ctypes.data % hugepages.ALIGN == 0 for a in arrays)
    assert hugepages.hold(streamed) == 0                           # never copied twice
    assert mapped.weight_cache.hugepage_bytes == 0
    assert all(_in_cache_file(lin.ws if lin.ws is not None else lin.qs) for lin in mapped.model.streamed_linears())
    assert np.array_equal(mapped.logits(ids), huge.logits(ids))
