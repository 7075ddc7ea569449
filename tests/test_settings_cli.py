"""Settings priority and validation; the command line's help and entry points."""
from __future__ import annotations

import subprocess
import sys

import pytest

from deltafin.cli import build_parser, main
from deltafin.settings import Settings, SettingsError, resolve_device


def test_priority_flag_over_env_over_default():
    assert Settings.resolve({}, env={}).io_workers == 8
    assert Settings.resolve({}, env={"DELTAFIN_IO_WORKERS": "3"}).io_workers == 3
    assert Settings.resolve({"io_workers": 5}, env={"DELTAFIN_IO_WORKERS": "3"}).io_workers == 5
    assert Settings.resolve({"io_workers": None}, env={"DELTAFIN_IO_WORKERS": "3"}).io_workers == 3
    assert Settings.resolve({}, env={"DELTAFIN_SPECULATE": "off"}).speculate is False


@pytest.mark.parametrize("env,needle", [
    ({"DELTAFIN_STREAM": "sometimes"}, "DELTAFIN_STREAM: invalid value 'sometimes' (allowed: auto, on, off)"),
    ({"DELTAFIN_IO_WORKERS": "many"}, "DELTAFIN_IO_WORKERS: invalid value 'many'"),
    ({"DELTAFIN_DEVICE": "tpu"}, "allowed: auto, cpu, cuda, cuda:N, mps"),
    ({"DELTAFIN_SPECULATE": "maybe"}, "DELTAFIN_SPECULATE"),
    ({"DELTAFIN_IO_WORKERS": "0"}, "'io_workers' must be >= 1"),
    ({"DELTAFIN_MAX_BATCH": "0"}, "'max_batch' must be >= 1"),
    ({"DELTAFIN_MAX_BATCH": "eight"}, "DELTAFIN_MAX_BATCH: invalid value 'eight'"),
    ({"DELTAFIN_PREFILL_CHUNK": "-4"}, "'prefill_chunk' must be >= 1"),
])
def test_invalid_values_name_the_variable_and_the_allowed_values(env, needle):
    with pytest.raises(SettingsError) as e:
        Settings.resolve({}, env=env)
    assert needle in str(e.value)


def test_unknown_setting_is_refused():
    with pytest.raises(SettingsError, match="unknown setting"):
        Settings.resolve({"warp_speed": 9}, env={})


def test_device_resolution():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda", "mps")
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(SettingsError, match="CUDA is not available"):
            resolve_device("cuda:1")


def test_help_lists_every_subcommand_and_knob(capsys):
    parser = build_parser()
    text = parser.format_help()
    for cmd in ("run", "serve", "convert", "verify", "bench", "inspect", "make-checkpoint"):
        assert cmd in text
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for flag in ("--device", "--stream", "--io-workers", "--read-mode", "--speculate", "DELTAFIN_PIN_LAYERS"):
        assert flag in out


def test_bad_setting_on_the_command_line_is_a_clean_error(capsys, tiny_k3_path):
    assert main(["run", "--model", str(tiny_k3_path), "--read-mode", "psychic", "hi"]) == 2
    assert "read_mode" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "deltafin", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "inspect" in out.stdout


def test_run_prints_text_and_a_summary(tiny_k3_path):
    out = subprocess.run([sys.executable, "-m", "deltafin", "run", "--model", str(tiny_k3_path),
                          "--max-new-tokens", "6", "--stream", "off", "--profile", "hello world"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "tokens in" in out.stderr and "tok/s" in out.stderr and "prefill" in out.stderr
    assert out.stdout.strip() != ""


def test_missing_model_path_is_a_clean_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", "--model", str(tmp_path / "nope"), "hi"]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err
    assert main(["run", "--model", "someone/not-here", "hi"]) == 2
    assert "Hugging Face hub" in capsys.readouterr().err
