"""Settings priority and validation; the command line's help and entry points."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import deltafin
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
    ({"DELTAFIN_CPU_EXPERTS": "maybe"}, "DELTAFIN_CPU_EXPERTS: invalid value 'maybe' (allowed: auto, on, off)"),
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


def test_the_commands_start_without_the_web_stack():
    """Only serving loads fastapi and uvicorn: the engine's commands work where only the engine's
    dependencies are installed (a GPU machine given the engine alone)."""
    code = ("import sys, deltafin.cli; deltafin.cli.build_parser(); "
            "print([m for m in ('uvicorn', 'fastapi', 'openai') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr + out.stdout


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


@pytest.mark.parametrize("command", [["inspect", "--json"], ["run", "--max-new-tokens", "2", "--stream", "off"]])
def test_a_closed_pipe_ends_a_printing_command_quietly(tiny_k3_path, command):
    """`deltafin inspect ... | head`: the reader is gone before deltafin writes; no traceback."""
    args = [command[0], *([str(tiny_k3_path)] if command[0] == "inspect" else ["--model", str(tiny_k3_path)]),
            *command[1:]]
    p = subprocess.Popen([sys.executable, "-m", "deltafin", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # long before the child has imported torch and printed anything
    err = p.stderr.read().decode()
    assert p.wait() == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


def test_help_says_what_auto_threads_and_16_bit_products_do(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "0 = auto: every core when the model is in RAM; when streaming, one fewer than the cores" in out
    assert "On the CPU decoding runs the same native kernels for every dtype, at the same speed" in out


def test_auto_threads_follow_where_the_model_is_computed():
    from deltafin.api import compute_threads
    from deltafin.settings import Settings
    auto, three = Settings.resolve({"threads": 0}), Settings.resolve({"threads": 3})
    cores = os.cpu_count() or 1
    assert compute_threads(auto, streaming=False) == cores
    assert compute_threads(auto, streaming=True) == max(1, cores - 1)
    assert compute_threads(auto, streaming=False, host_computes=False) == 1  # a device holds the whole model
    assert compute_threads(three, streaming=False, host_computes=False) == 3


def test_start_up_line_says_what_auto_threads_chose(tiny_k3_path):
    import torch
    from deltafin.startup import threads_message
    try:
        m = deltafin.load(tiny_k3_path, device="cpu", stream="off", threads=0)
        assert m.threads == (os.cpu_count() or 1)
        assert threads_message(m).endswith("(auto, model in RAM: every core)")
        m = deltafin.load(tiny_k3_path, device="cpu", stream="on", threads=0)
        cores = os.cpu_count() or 1
        assert m.threads == max(1, cores - 1)
        rows = (f"; {cores} for the products of a pass of several rows, and of one-token passes once they "
                "stop reading from disk as they compute" if cores > 1 else "")
        assert threads_message(m).endswith(f"(auto, streaming: one core left to the readers{rows})")
        m = deltafin.load(tiny_k3_path, device="cpu", stream="off", threads=3)
        assert threads_message(m) == "3 compute threads (set)"
        assert m.host_computes and m.engine.gather_threads is None
    finally:
        torch.set_num_threads(1)  # process-wide; the other tests run with one
