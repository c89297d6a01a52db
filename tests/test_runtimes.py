"""The tests' runtime factory (`runtimes.RuntimeFactory`): leases with the same settings share
one runtime process, an idle one is kept for the next lease (the tiny model's only) unless it
died, and the factory's end stops them all."""

import shutil

from runtimes import RuntimeFactory

SHORT = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}


def _serves(runtime) -> bool:
    out = runtime.generate(input_ids=[5, 6, 7], sampling_params=SHORT)
    return out["meta_info"]["completion_tokens"] == 2


def test_leases_share_a_runtime_by_settings(tiny_model_dir, tmp_path):
    factory = RuntimeFactory(keep_idle_for=tiny_model_dir)
    try:
        with factory.lease(tiny_model_dir, max_total_tokens=512) as a:
            with factory.lease(tiny_model_dir, max_total_tokens=512) as b:
                assert b is a and _serves(b)
        with factory.lease(tiny_model_dir, max_total_tokens=512) as c:
            assert c is a and factory.starts == 1  # kept idle in between
        with factory.lease(tiny_model_dir, max_total_tokens=768) as d:
            assert d is not a and factory.starts == 2 and _serves(d)

        a._proc.kill()  # dies while idle: the next lease starts another
        a._proc.wait()
        with factory.lease(tiny_model_dir, max_total_tokens=512) as e:
            assert e is not a and factory.starts == 3 and _serves(e)

        other = shutil.copytree(tiny_model_dir, tmp_path / "other-model")
        with factory.lease(other) as f:
            assert _serves(f)
        assert f._proc.poll() is not None  # not the tiny model's: stopped at its last release
    finally:
        factory.close()
    assert d._proc.poll() is not None and e._proc.poll() is not None
