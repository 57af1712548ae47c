"""Report paths: nothing machine-specific is written into committed results."""
import os

from specjax.paths import portable_argv, portable_path, portable_values


def test_paths_inside_cwd_and_home_become_relative(tmp_path, monkeypatch):
    home, repo = tmp_path / "home", tmp_path / "repo"
    (repo / "runs").mkdir(parents=True)
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(repo)
    assert portable_path(str(repo / "runs" / "a")) == os.path.join("runs", "a")
    assert portable_path(str(repo)) == "."
    assert portable_path(str(home / ".cache" / "t")) == "~/" + os.path.join(".cache", "t")
    assert portable_path("runs/a") == os.path.join("runs", "a")
    assert portable_argv(["--workdir", str(repo / "w"), f"--t={home}/x", "--n", "3"]) == \
        ["--workdir", "w", "--t=~/x", "--n", "3"]
    assert portable_values({"a": str(repo / "p"), "b": 3, "c": "fixed4"}) == \
        {"a": "p", "b": 3, "c": "fixed4"}
