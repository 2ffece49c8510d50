"""The disk tier: evicted blocks spill, misses look on disk, bad files are never used."""

import os
import stat

import pytest
import torch

from clm_middleware.cache import PoolConfig
from clm_middleware.engine import Engine

EXACT = 1e-4


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 3 * i) % 250 for i in range(length)]


def disk_engine(tiny_model, tiny_tok, directory, **kwargs) -> Engine:
    kwargs.setdefault("pool_config", PoolConfig(max_blocks=8))
    return Engine(tiny_model, tiny_tok, disk_cache_dir=directory, **kwargs)


def recomputed(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def push_out(engine: Engine) -> None:
    """Fill the small pool with other prompts so earlier blocks are evicted."""
    for offset in range(1, 4):
        engine.generate(prompt_of(64, offset=offset * 41), max_new_tokens=0).result()


def test_evicted_blocks_spill_and_a_memory_miss_hits_from_disk_exactly(tiny_model, tiny_tok, tmp_path):
    engine = disk_engine(tiny_model, tiny_tok, tmp_path)
    prompt = prompt_of(60)
    engine.generate(prompt, max_new_tokens=0).result()
    push_out(engine)
    assert engine.disk_stats()["disk_writes"] > 0
    generation = engine.generate([*prompt, 7, 8, 9], max_new_tokens=1, return_logits=True).result()
    assert generation.stats.disk_tokens == 48 and generation.stats.cached_tokens == 48
    assert engine.disk_stats()["disk_hits"] == 3
    assert (generation.logits[0] - recomputed(tiny_model, [*prompt, 7, 8, 9])).abs().max() <= EXACT
    engine.pool.check_invariants()


def test_after_a_restart_the_same_conversation_hits_from_disk(tiny_model, tiny_tok, tmp_path):
    prompt = prompt_of(70, offset=5)
    with disk_engine(tiny_model, tiny_tok, tmp_path, pool_config=PoolConfig(max_blocks=64)) as first:
        first.generate(prompt, max_new_tokens=0).result()
    restarted = disk_engine(tiny_model, tiny_tok, tmp_path, pool_config=PoolConfig(max_blocks=64))
    generation = restarted.generate([*prompt, 1], max_new_tokens=1).result()
    assert generation.stats.disk_tokens == 64
    assert generation.stats.cached_tokens == 64  # the 6-token partial tail was kept in memory only
    assert restarted.disk_stats()["disk_hits"] == 4


@pytest.mark.parametrize("damage", ["zero-byte", "truncated", "wrong-tokens", "flipped-byte", "header-a-list"])
def test_a_bad_file_is_a_miss_deleted_counted_and_never_used(tiny_model, tiny_tok, tmp_path, damage):
    prompt = prompt_of(40, offset=9)
    with disk_engine(tiny_model, tiny_tok, tmp_path, pool_config=PoolConfig(max_blocks=64)) as first:
        first.generate(prompt, max_new_tokens=0).result()
    restarted = disk_engine(tiny_model, tiny_tok, tmp_path, pool_config=PoolConfig(max_blocks=64))
    files = sorted(restarted.disk.directory.glob("*.safetensors"))
    first_block = restarted.disk.path(_first_key(restarted, prompt))
    assert first_block in files
    payload = first_block.read_bytes()
    if damage == "zero-byte":
        first_block.write_bytes(b"")
    elif damage == "truncated":
        first_block.write_bytes(payload[: len(payload) // 2])
    elif damage == "wrong-tokens":
        other = restarted.disk.path(_first_key(restarted, prompt_of(40, offset=1)))
        first_block.rename(other)  # a valid block file under someone else's key
        first_block = other
        _store_block_under(restarted, prompt, payload)  # the genuine one moved away: re-plant it at its name
        restarted.disk.path(_first_key(restarted, prompt)).unlink()
        payload = other.read_bytes()
    elif damage == "header-a-list":  # JSON, but not a safetensors header
        header = b"[]"
        rest = payload[8 + int.from_bytes(payload[:8], "little") :]
        first_block.write_bytes(len(header).to_bytes(8, "little") + header + rest)
    else:
        first_block.write_bytes(payload[:-10] + bytes([payload[-10] ^ 0xFF]) + payload[-9:])
    probe = prompt if damage != "wrong-tokens" else prompt_of(40, offset=1)
    generation = restarted.generate([*probe, 3], max_new_tokens=1, return_logits=True).result()
    assert restarted.disk_stats()["disk_corrupt"] == 1
    assert not first_block.exists()
    assert generation.stats.disk_tokens == 0
    assert (generation.logits[0] - recomputed(tiny_model, [*probe, 3])).abs().max() <= EXACT


def _first_key(engine: Engine, tokens):
    from clm_middleware.cache.hashing import chain_keys

    return chain_keys(tokens, engine.block_size, engine.extra_key())[0]


def _store_block_under(engine: Engine, tokens, payload: bytes) -> None:
    engine.disk.path(_first_key(engine, tokens)).write_bytes(payload)


def test_writes_are_skipped_with_a_warning_when_free_space_is_low(tiny_model, tiny_tok, tmp_path):
    engine = disk_engine(tiny_model, tiny_tok, tmp_path, min_free_disk_mb=10**9)
    engine.generate(prompt_of(60), max_new_tokens=0).result()
    with pytest.warns(RuntimeWarning, match="skipping writes"):
        push_out(engine)
    stats = engine.disk_stats()
    assert stats["disk_writes"] == 0 and stats["disk_skipped_writes"] > 0


def test_a_size_cap_keeps_the_most_recently_used_files(tiny_model, tiny_tok, tmp_path):
    from clm_middleware.cache import KVLayout

    block_file = KVLayout.from_model(tiny_model).bytes_per_token * 16 + 1024  # K/V bytes plus a header, at most
    engine = disk_engine(tiny_model, tiny_tok, tmp_path, max_disk_bytes=6 * block_file)
    for offset in range(6):
        engine.generate(prompt_of(64, offset=offset * 17), max_new_tokens=0).result()
    files = list(engine.disk.directory.glob("*.safetensors"))
    assert 0 < len(files) <= 6
    assert engine.disk_stats()["disk_evicted_files"] > 0


def test_disk_cache_files_are_owner_only(tiny_model, tiny_tok, tmp_path):
    engine = disk_engine(tiny_model, tiny_tok, tmp_path / "new" / "kv")
    engine.generate(prompt_of(60), max_new_tokens=0).result()
    push_out(engine)
    for folder in (engine.disk.directory, tmp_path / "new" / "kv", tmp_path / "new"):  # each folder it created
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for path in engine.disk.directory.glob("*.safetensors"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


# ---------------------------------------------------------------- disk faults: never reach a caller


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs with 8 inodes (root only; skipped where mounting is not allowed)."""
    import subprocess

    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M,nr_inodes=8", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_an_unusable_cache_directory_disables_the_tier_with_one_warning(tiny_model, tiny_tok, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    with pytest.warns(RuntimeWarning, match="disk tier is off"):
        engine = disk_engine(tiny_model, tiny_tok, blocker)
    assert engine.disk is not None and not engine.disk.enabled
    engine.generate(prompt_of(60), max_new_tokens=4).result()
    push_out(engine)
    engine.close()
    assert engine.pool.stats().blocks_in_use == 0


def test_a_full_disk_never_fails_a_call_nor_leaks_a_block(tiny_model, tiny_tok, small_tmpfs):
    engine = disk_engine(tiny_model, tiny_tok, small_tmpfs, pool_config=PoolConfig(max_blocks=24), min_free_disk_mb=0)
    with pytest.warns(RuntimeWarning, match="a write failed"):
        for offset in range(8):
            engine.generate(prompt_of(150, offset=offset * 7), max_new_tokens=2).result()
    assert engine.pool.stats().blocks_in_use == 0
    assert engine.disk_stats()["disk_errors"] > 0
    engine.close()  # the spill hits the same full disk: skipped, not raised
    engine.pool.check_invariants()


def test_a_read_only_disk_never_fails_a_call(tiny_model, tiny_tok, small_tmpfs):
    import subprocess

    engine = disk_engine(tiny_model, tiny_tok, small_tmpfs, min_free_disk_mb=0)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.warns(RuntimeWarning, match="a write failed"):
        engine.generate(prompt_of(60), max_new_tokens=2).result()
        push_out(engine)
    engine.close()
    assert engine.pool.stats().blocks_in_use == 0 and engine.disk_stats()["disk_errors"] > 0


def test_a_directory_at_a_keys_path_is_a_miss_not_a_crash(tiny_model, tiny_tok, tmp_path):
    engine = disk_engine(tiny_model, tiny_tok, tmp_path)
    prompt = prompt_of(60)
    engine.generate(prompt, max_new_tokens=0).result()
    push_out(engine)
    for path in engine.disk.directory.glob("*.safetensors"):
        path.unlink()
        path.mkdir()  # a directory where a block file should be
    with pytest.warns(RuntimeWarning, match="a read failed"):
        again = engine.generate(prompt, max_new_tokens=0).result()
    assert again.stats.disk_tokens == 0 and engine.disk_stats()["disk_errors"] > 0
