"""``loraplex serve --ray`` flags (usage errors before anything starts), and the
single-process server never importing ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from loraplex.cli import build_parser, main


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


def test_ray_flags_exist() -> None:
    text = build_parser().parse_args(["serve"]).command_parser.format_help()
    for flag in ("--ray", "--ray-address", "--num-replicas", "--min-replicas",
                 "--max-replicas", "--replica-cpus", "--replica-gpus"):
        assert flag in text, flag
    assert "every interface" in text  # --host is not honoured through Ray's proxy


@pytest.mark.parametrize("argv,words", [
    (["--num-replicas", "2"], "--num-replicas only apply with --ray"),
    (["--ray", "--num-replicas", "2", "--max-replicas", "3"], "not both"),
    (["--ray", "--num-replicas", "0"], "--num-replicas 0 must be >= 1"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "0 <= min <= max"),
])
def test_bad_ray_flag_is_usage_error(capsys, tmp_path: Path, argv: list[str], words: str
                                     ) -> None:
    assert words in usage_error(capsys, "serve", "--model", str(tmp_path), *argv)


def test_ray_options_autoscaling() -> None:
    from loraplex.server.ray.launch import RayOptions

    auto = RayOptions(min_replicas=1, max_replicas=4)
    opts = auto.deployment_options(40, 32, 0.0)
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                          "target_ongoing_requests": 32}
    assert "num_replicas" not in opts and auto.serving_replicas == 1
    assert RayOptions().num_replicas == 1
    assert RayOptions(num_replicas=3).deployment_options(40, 32, 1.0)["ray_actor_options"] == \
        {"num_cpus": 1.0, "num_gpus": 1.0}


def test_single_process_server_does_not_import_ray() -> None:
    code = ("import sys, loraplex.server.loraplex_server, loraplex.cli, loraplex.client; "
            "loraplex.cli.build_parser(); assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
