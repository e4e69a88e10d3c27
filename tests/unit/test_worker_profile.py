"""YATT_PROFILE_DIR: a rank's run under cProfile, its stats left where the variable says."""
import pstats

from yatt_hpc.runtime.worker import profiled


def test_a_rank_leaves_its_profile_only_when_asked(tmp_path, monkeypatch):
    def work(group, run_dir):
        return sum(range(1000)), group, run_dir

    monkeypatch.delenv("YATT_PROFILE_DIR", raising=False)
    assert profiled(work, "trainer", tmp_path, rank=3) == (499500, "trainer", tmp_path)
    assert not list(tmp_path.rglob("*.prof"))
    monkeypatch.setenv("YATT_PROFILE_DIR", str(tmp_path / "prof"))
    assert profiled(work, "genrm", tmp_path, rank=3)[0] == 499500
    stats = pstats.Stats(str(tmp_path / "prof" / "rank-0003-genrm.prof"))
    assert any(name == "work" for (_, _, name) in stats.stats)
