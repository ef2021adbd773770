"""Environment variables read by aluminum_py.config: defaults and bad values."""
import pytest

from aluminum_py import config


@pytest.mark.parametrize("name,read,default", [
    ("AL_ENGINE_SERIAL_BYTES", config.engine_serial_bytes, 1 << 20),
    ("AL_SCRATCH_CACHE", config.scratch_cache, 256 << 20),
    ("AL_SHM_STREAM_BYTES", config.shm_stream_bytes, None),
])
def test_byte_counts(monkeypatch, name, read, default):
    monkeypatch.delenv(name, raising=False)
    assert read() == default
    monkeypatch.setenv(name, "0")
    assert read() == 0
    monkeypatch.setenv(name, "4e6")
    assert read() == 4_000_000
    for bad in ("-1", "inf", "nan", "lots"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            read()


def test_wait_spin(monkeypatch):
    monkeypatch.delenv("AL_WAIT_SPIN", raising=False)
    assert config.wait_spin() == 5e-6
    monkeypatch.setenv("AL_WAIT_SPIN", "-1")
    assert config.wait_spin() == -1.0
    monkeypatch.setenv("AL_WAIT_SPIN", "soon")
    with pytest.raises(ValueError, match="AL_WAIT_SPIN"):
        config.wait_spin()


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """cpu0's caches in a sysfs of our own: L1d 32K, L1i 64M, L2 1024K, L3 32768K (returned:
    the directory; its files can be rewritten)."""
    for index, (level, kind, size) in enumerate(((1, "Data", "32K"), (1, "Instruction", "64M"),
                                                 (2, "Unified", "1024K"), (3, "Unified", "32768K"))):
        d = tmp_path / "cpu0" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    real_listdir, real_open = config.os.listdir, open

    def moved(path):
        return str(path).replace("/sys/devices/system/cpu", str(tmp_path))
    monkeypatch.setattr(config.os, "listdir", lambda path: real_listdir(moved(path)))
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(moved(path), *a, **k))
    return tmp_path


def test_last_level_cache_bytes(caches):
    """The largest data or unified cache sysfs lists (K/M suffixes), 32 MiB where none can be
    read; an instruction cache never counts."""
    tmp_path = caches
    assert config.last_level_cache_bytes() == 32 << 20
    (tmp_path / "cpu0" / "cache" / "index3" / "size").write_text("96M\n")
    assert config.last_level_cache_bytes() == 96 << 20
    assert config.last_level_cache_bytes(cpu=7) == 32 << 20     # no such CPU: the fallback


def test_shm_chunk_bytes(caches, monkeypatch):
    """An "shm" allreduce's round: a quarter of the core's L2 (1 MiB here) where every rank has
    a core, the slot where ranks outnumber cores, 256 KiB where no L2 is listed; at least
    64 KiB, at most the slot; a value given is used up to the slot."""
    monkeypatch.delenv("AL_SHM_CHUNK_BYTES", raising=False)
    assert config.cache_bytes(0, 2) == 1 << 20
    assert config.shm_chunk_bytes(1 << 20, False) == 256 << 10
    assert config.shm_chunk_bytes(128 << 10, False) == 128 << 10
    assert config.shm_chunk_bytes(1 << 20, True) == 1 << 20
    (caches / "cpu0" / "cache" / "index2" / "size").write_text("128K\n")
    assert config.shm_chunk_bytes(1 << 20, False) == 64 << 10
    (caches / "cpu0" / "cache" / "index2" / "level").write_text("4\n")
    assert config.cache_bytes(0, 2) == 0
    assert config.shm_chunk_bytes(1 << 20, False) == 256 << 10
    monkeypatch.setenv("AL_SHM_CHUNK_BYTES", "8192")
    assert config.shm_chunk_bytes(1 << 20, True) == 8192
    monkeypatch.setenv("AL_SHM_CHUNK_BYTES", "4e6")
    assert config.shm_chunk_bytes(1 << 20, False) == 1 << 20
    monkeypatch.setenv("AL_SHM_CHUNK_BYTES", "10000")             # whole pages: down to 8 KiB
    assert config.shm_chunk_bytes(1 << 20, False) == 8192
    (caches / "cpu0" / "cache" / "index2" / "level").write_text("2\n")
    (caches / "cpu0" / "cache" / "index2" / "size").write_text("1280K\n")
    monkeypatch.delenv("AL_SHM_CHUNK_BYTES")
    assert config.shm_chunk_bytes(1 << 20, False) == 320 << 10


def test_wait_nap(monkeypatch):
    monkeypatch.delenv("AL_WAIT_NAP", raising=False)
    assert config.wait_nap() == 2.5e-4
    monkeypatch.setenv("AL_WAIT_NAP", "0")
    assert config.wait_nap() == 0.0
    for bad in ("-1", "soon", "5"):
        monkeypatch.setenv("AL_WAIT_NAP", bad)
        with pytest.raises(ValueError, match="AL_WAIT_NAP"):
            config.wait_nap()


def test_shm_slot_stores(monkeypatch):
    monkeypatch.delenv("AL_SHM_SLOT_STORES", raising=False)
    assert config.shm_slot_stores() == 0
    for i, name in enumerate(config.SHM_SLOT_STORES):
        monkeypatch.setenv("AL_SHM_SLOT_STORES", f" {name.upper()} ")
        assert config.shm_slot_stores() == i
    for bad in ("2", "nt", "stream"):
        monkeypatch.setenv("AL_SHM_SLOT_STORES", bad)
        with pytest.raises(ValueError, match="AL_SHM_SLOT_STORES.*auto, cached or streamed"):
            config.shm_slot_stores()
