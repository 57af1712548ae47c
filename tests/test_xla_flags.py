"""The suite's compile-time XLA flags (_xla_flags.py): set where missing, never over a user's."""
import os

from _xla_flags import compile_speed_flags, with_compile_speed_flags, without_device_count


def test_compile_speed_flags_fill_in_and_keep_what_the_user_set():
    flags = compile_speed_flags()
    assert flags["xla_backend_optimization_level"] == "0"
    got = with_compile_speed_flags("--xla_force_host_platform_device_count=2")
    assert got.split() == ["--xla_force_host_platform_device_count=2",
                           *(f"--{k}={v}" for k, v in flags.items())]
    user = "--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=true"
    kept = with_compile_speed_flags(user).split()
    assert kept[:2] == user.split()
    assert not any(f.startswith("--xla_backend_optimization_level=0") for f in kept)
    assert not any(f == "--xla_cpu_use_fusion_emitters=false" for f in kept)
    assert with_compile_speed_flags(with_compile_speed_flags("")) == with_compile_speed_flags("")


def test_this_process_compiles_with_them_and_subprocesses_choose_their_device_count():
    # conftest.py set them before JAX started (a flag this jaxlib rejected would have stopped it).
    env = os.environ["XLA_FLAGS"]
    assert with_compile_speed_flags(env) == " ".join(env.split())
    assert without_device_count(env + " --xla_force_host_platform_device_count=3").split() == [
        f for f in env.split() if "device_count" not in f]
