"""The prefix cache: shared blocks, greedy answers identical cold / warm / after eviction / after a
restart from disk, bad disk files skipped, sparse attention's per-block data kept with its blocks."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from appliance import Engine
from appliance.engine.kv_store_disk import FIXED, MAGIC
from appliance.engine.prefix_cache import block_hash

SPARSE = {"k": 4, "block": 8, "probe": 8, "probe_mode": "bound"}    # active past 4 blocks of 8


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(5, 400, size=n)]


def greedy(engine, ids, n: int = 12) -> list[int]:
    return engine.generate(list(ids), stream=False, max_tokens=n, temperature=0.0, ignore_eos=True)["token_ids"]


@pytest.fixture(scope="module")
def cold(tiny_qwen3_dir):
    return Engine.load(tiny_qwen3_dir, max_context=512, progress=False)


@pytest.fixture
def warm(tiny_qwen3_dir):
    return Engine.load(tiny_qwen3_dir, max_context=512, prefix_cache=True, progress=False)


def test_a_warm_prompt_gives_the_cold_answer(cold, warm):
    ids = prompt(150)
    want = greedy(cold, ids)
    assert greedy(warm, ids) == want                     # first time: a miss
    stats = warm.prefix_cache_stats()
    assert (stats.query_tokens, stats.hit_tokens) == (150, 0)
    assert greedy(warm, ids) == want                     # again: 4 full blocks (the 5th holds the last token)
    assert warm.prefix_cache_stats().hit_tokens == 128
    assert warm.kv_blocks_used == 0 and warm.prefix_cache_stats().blocks_idle > 0


def test_the_next_turn_starts_from_the_answer(cold, warm):
    """Blocks filled by decoding are cached too: a chat's next turn reuses prompt and answer."""
    ids = prompt(70, seed=1)
    answer = greedy(warm, ids, n=60)
    turn2 = ids + answer + prompt(20, seed=2)
    assert greedy(warm, turn2) == greedy(cold, turn2)
    assert warm.prefix_cache_stats().hit_tokens == (len(ids) + len(answer)) // 32 * 32


def test_sequences_share_a_prefix_by_reference_and_diverge(cold, warm):
    shared = prompt(96, seed=3)
    a_ids, b_ids = shared + prompt(10, seed=4), shared + prompt(13, seed=5)
    params = warm.sampling_params(max_tokens=8, temperature=0.0, ignore_eos=True)
    a = warm.start(a_ids, params)
    warm.prefill(a)
    b = warm.start(b_ids, params)
    assert b.blocks.cached_tokens == 96 and b.blocks.blocks[:3] == a.blocks.blocks[:3]
    assert all(warm.cache.pool.refs[blk] == 2 for blk in a.blocks.blocks[:3])
    assert b.blocks.blocks[3] != a.blocks.blocks[3]      # where they differ, each has its own
    out = {a.id: [a.output_ids[0]], b.id: [warm.prefill(b).token_id]}
    while not (a.done and b.done):
        for seq, ev in warm.step([s for s in (a, b) if not s.done]):
            out[seq.id].append(ev.token_id)
    assert out[a.id] == greedy(cold, a_ids, 8) and out[b.id] == greedy(cold, b_ids, 8)
    warm.release(a)
    assert all(warm.cache.pool.refs[blk] == 1 for blk in b.blocks.blocks[:3])
    warm.release(b)
    assert warm.kv_blocks_used == 0


def test_evicted_blocks_are_recomputed(tiny_qwen3_dir, cold):
    small = Engine.load(tiny_qwen3_dir, max_context=256, kv_cache_tokens=256, prefix_cache=True, progress=False)
    first, second = prompt(200, seed=6), prompt(200, seed=7)
    want = greedy(cold, first)
    assert greedy(small, first) == want
    assert greedy(small, second) == greedy(cold, second)       # needs the blocks `first` left idle
    assert small.prefix_cache_stats().evictions > 0
    assert greedy(small, first) == want


def test_preempted_sequence_resumes_where_it_stopped(cold, warm):
    ids = prompt(80, seed=8)
    want = greedy(cold, ids, 30)
    seq = warm.start(ids, warm.sampling_params(max_tokens=30, temperature=0.0, ignore_eos=True))
    tokens = [warm.prefill(seq).token_id]
    for _ in range(12):
        tokens += [e.token_id for e in warm.decode([seq])]
    warm.preempt(seq)
    assert warm.kv_blocks_used == 0 and not seq.prefilled
    warm.resume(seq)
    assert seq.blocks.cached_tokens == 64                  # its two full blocks were still cached
    while not seq.prefilled:
        assert warm.step([], [(seq, 512)]) == []           # recomputes, no token
    while not seq.done:
        tokens += [e.token_id for e in warm.decode([seq])]
    warm.release(seq)
    assert tokens == want


def test_a_mixed_step_gives_each_sequence_its_solo_answer(cold):
    """Decode rows of one sequence and prompt chunks of another in the same forward passes."""
    a_ids, b_ids = prompt(40, seed=9), prompt(150, seed=10)
    params = cold.sampling_params(max_tokens=20, temperature=0.0, ignore_eos=True)
    a, b = cold.start(a_ids, params), cold.start(b_ids, params)
    got = {a.id: [cold.prefill(a).token_id], b.id: []}
    while not (a.done and b.done):
        prefill = [(b, 48)] if not b.prefilled else []
        for seq, ev in cold.step([s for s in (a,) + ((b,) if b.prefilled else ()) if not s.done], prefill):
            got[seq.id].append(ev.token_id)
    cold.release(a)
    cold.release(b)
    assert got[a.id] == greedy(cold, a_ids, 20) and got[b.id] == greedy(cold, b_ids, 20)


# ---- the disk tier -------------------------------------------------------------------------

def disk_engine(model_dir, directory, **kw):
    return Engine.load(model_dir, max_context=512, prefix_cache=True, kv_cache_dir=directory, progress=False, **kw)


def block_file(engine, ids, index: int = 0):
    """The file of block `index` of this prompt."""
    name = engine.prefix.root
    for j in range(index + 1):
        name = block_hash(name, ids[j * 32:(j + 1) * 32])
    info = engine.prefix.store.find(name)
    assert info is not None
    return info.path


def test_a_restarted_engine_serves_the_next_turn_from_disk(tiny_qwen3_dir, cold, tmp_path):
    ids = prompt(150, seed=11)
    first = disk_engine(tiny_qwen3_dir, tmp_path)
    answer = greedy(first, ids)
    assert first.close(timeout=30)
    assert first.prefix_cache_stats().disk.written >= 4
    turn2 = ids + answer + prompt(30, seed=12)
    again = disk_engine(tiny_qwen3_dir, tmp_path)
    assert greedy(again, turn2) == greedy(cold, turn2)
    stats = again.prefix_cache_stats()
    assert stats.disk_hit_tokens == stats.hit_tokens == (150 + 12) // 32 * 32
    assert stats.disk.loaded == stats.hit_tokens // 32 and sum(stats.disk.rejected.values()) == 0


def test_another_format_never_sees_the_files(tiny_qwen3_dir, tmp_path):
    ids = prompt(100, seed=13)
    first = disk_engine(tiny_qwen3_dir, tmp_path)
    greedy(first, ids)
    first.close()
    q4 = disk_engine(tiny_qwen3_dir, tmp_path, kv="q4")
    assert q4.prefix.root != first.prefix.root
    greedy(q4, ids)
    assert q4.prefix_cache_stats().hit_tokens == 0


def _flip_payload_byte(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _old_version(path):
    data = bytearray(path.read_bytes())
    version, n, crc = FIXED.unpack_from(data, len(MAGIC))
    struct.pack_into("<I", data, len(MAGIC), version + 1)
    path.write_bytes(bytes(data))


def _other_block(path, other):
    path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("damage, reason", [(_flip_payload_byte, "corrupt"), (_truncate, "truncated"),
                                            (_old_version, "stale"), (_other_block, "foreign")])
def test_a_bad_cache_file_is_skipped_and_removed(tiny_qwen3_dir, cold, tmp_path, damage, reason, caplog):
    ids = prompt(150, seed=14)
    first = disk_engine(tiny_qwen3_dir, tmp_path)
    want = greedy(first, ids)
    first.close()
    again = disk_engine(tiny_qwen3_dir, tmp_path)
    target = block_file(again, ids, 0)
    if damage is _other_block:
        damage(target, block_file(again, ids, 1))
    else:
        damage(target)
    with caplog.at_level("WARNING", logger="appliance.kv_disk"):
        assert greedy(again, ids) == want == greedy(cold, ids)
    stats = again.prefix_cache_stats()
    assert stats.disk.rejected[reason] == 1 and stats.disk_hit_tokens == 0
    assert not target.exists()
    assert sum(1 for r in caplog.records if "skipped" in r.getMessage()) == 1


def test_the_directory_stays_within_its_bound(tiny_qwen3_dir, tmp_path):
    engine = disk_engine(tiny_qwen3_dir, tmp_path)
    one_block = engine.cache.block_layout()
    block_bytes = sum(np.dtype(d).itemsize * int(np.prod(s)) for d, s in one_block.values())
    bounded = disk_engine(tiny_qwen3_dir, tmp_path, kv_cache_disk_bytes=6 * block_bytes + 6 * 1024)
    for seed in range(4):
        greedy(bounded, prompt(130, seed=20 + seed))
    bounded.close()
    stats = bounded.prefix_cache_stats().disk
    assert stats.written >= 16 and stats.removed > 0
    assert stats.bytes <= stats.max_bytes
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kvb")) == stats.bytes


def test_header_names_the_block(tiny_qwen3_dir, tmp_path):
    ids = prompt(70, seed=15)
    engine = disk_engine(tiny_qwen3_dir, tmp_path)
    greedy(engine, ids)
    engine.close()
    data = block_file(engine, ids, 0).read_bytes()
    _, n, _ = FIXED.unpack_from(data, len(MAGIC))
    header = json.loads(data[len(MAGIC) + FIXED.size:len(MAGIC) + FIXED.size + n])
    assert header["tokens"] == ids[:32] and header["parent"] == engine.prefix.root.hex()
    assert {a[0] for a in header["arrays"]} == {"k", "v", "k_scale", "v_scale"}


# ---- block-sparse attention ------------------------------------------------------------------

def test_sparse_attention_hits_give_the_cold_answer(tiny_qwen3_dir, tmp_path):
    """Importance and bound rows come with the cached blocks (memory and disk): the same tokens."""
    cold_sparse = Engine.load(tiny_qwen3_dir, max_context=512, sparse=SPARSE, progress=False)
    ids = prompt(120, seed=16)
    want = greedy(cold_sparse, ids, 16)
    warm = disk_engine(tiny_qwen3_dir, tmp_path, sparse=SPARSE)
    assert greedy(warm, ids, 16) == want
    assert greedy(warm, ids, 16) == want
    assert warm.prefix_cache_stats().hit_tokens == 112          # up to the last full block before the end
    turn2 = ids + want + prompt(20, seed=17)
    assert greedy(warm, turn2) == greedy(cold_sparse, turn2)
    warm.close()
    files = list(tmp_path.rglob("*.imp.kvb"))
    assert files and "bound_k" in warm.cache.block_layout()
    restarted = disk_engine(tiny_qwen3_dir, tmp_path, sparse=SPARSE)
    assert greedy(restarted, ids, 16) == want
    assert restarted.prefix_cache_stats().disk_hit_tokens == 112


# ---- images ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory):
    from tiny_models_vl import build_qwen3_vl
    return Engine.load(build_qwen3_vl(tmp_path_factory.mktemp("vl_prefix")), prefix_cache=True, progress=False)


def test_image_content_is_part_of_the_blocks_name(vl_engine):
    from PIL import Image
    from tiny_models_vl import test_picture

    picture = test_picture(100, 72)
    mirrored = picture.transpose(Image.Transpose.FLIP_LEFT_RIGHT)       # same size: same token ids
    text = "Edge boards run language models on their CPUs with int8 kernels. " * 3
    ids = vl_engine.encode_prompt([{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image"}, {"type": "text", "text": "What is it?"}]}])

    def run(image):
        seq = vl_engine.start(ids, vl_engine.sampling_params(max_tokens=4, temperature=0.0, ignore_eos=True),
                              images=[image])
        out = [vl_engine.prefill(seq).token_id]
        while not seq.done:
            out += [e.token_id for e in vl_engine.decode([seq])]
        cached, first_image_row = seq.blocks.cached_tokens, int(np.argmax(seq.vision.image_index >= 0))
        vl_engine.release(seq)
        return out, cached, first_image_row

    first, _, image_row = run(picture)
    again, cached, _ = run(picture)
    assert again == first and cached > image_row                    # the image's blocks came from the cache
    _, cached_other, _ = run(mirrored)
    assert cached_other == image_row // 32 * 32                     # up to the block the image starts in


# ---- the pool's size ---------------------------------------------------------------------

def test_the_pool_is_sized_by_tokens_or_memory(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="smaller than the context"):
        Engine.load(tiny_qwen3_dir, max_context=256, kv_cache_tokens=128, progress=False)
    per_token = 2 * 2 * 2 * (32 + 4)                                # layers x K,V x kv heads x (hd + scale)
    sized = Engine.load(tiny_qwen3_dir, max_context=256, kv_cache_memory="2M", progress=False)
    assert sized.info()["kv_tokens_total"] == -(-(2 << 20) // per_token // 32) * 32
    default = Engine.load(tiny_qwen3_dir, max_context=256, progress=False)
    assert 256 <= default.info()["kv_tokens_total"] <= 16 * 256 + 31
    with pytest.raises(ValueError, match="smaller than the context"):
        Engine.load(tiny_qwen3_dir, max_context=4096, kv_cache_memory="1M", progress=False)
