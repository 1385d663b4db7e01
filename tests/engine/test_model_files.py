"""What a model path says before any weight is read (pdserve.engine.model_files), torch-free:

- a real GGUF file and a real model folder pass the check; a missing path, a folder without
  config.json, a file that is not .gguf and a .gguf that is not GGUF each get one sentence
  starting with the path;
- recommended sampling settings come from a folder's generation_config.json or a GGUF's
  `general.sampling.*` keys, only those present; a bad value names the file and the field.
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest

from pdserve.engine.model_files import (CheckpointError, model_path_problem,
                                        recommended_sampling)


def test_imports_without_torch():
    code = ("import sys, pdserve.engine.model_files as m; m.default_model_path(); "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_real_models_pass(smollm2_gguf_path, tiny_llama_dir):
    assert model_path_problem(smollm2_gguf_path) is None
    assert model_path_problem(tiny_llama_dir) is None


def test_each_bad_path_gets_a_sentence_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "w.bin").write_bytes(b"GGUF")
    (tmp_path / "f.gguf").write_bytes(b"GGU")  # truncated: not even the magic
    cases = {"missing": "no such file or folder", "empty": "folder without config.json",
             "w.bin": "neither a .gguf file nor a folder with config.json",
             "f.gguf": "is not a GGUF file"}
    for name, says in cases.items():
        path = str(tmp_path / name)
        problem = model_path_problem(path)
        assert problem is not None and problem.startswith(path) and says in problem, problem


def test_sampling_from_generation_config(tmp_path, tiny_llama_dir):
    assert recommended_sampling(tiny_llama_dir) == ({}, "")
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}))
    values, source = recommended_sampling(str(tmp_path))
    assert values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert source == str(tmp_path / "generation_config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": None,
                                                                 "top_k": -1}))
    assert recommended_sampling(str(tmp_path))[0] == {"top_k": 0}  # -1 and 0 both mean off
    for bad, field in (({"top_p": 0}, "top_p"), ({"temperature": "hot"}, "temperature"),
                       ({"temperature": 5.0}, "temperature"), ({"top_k": 2.5}, "top_k")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=f"generation_config.json: {field}"):
            recommended_sampling(str(tmp_path))


def test_sampling_from_gguf_keys(tmp_path, smollm2_gguf_path):
    assert recommended_sampling(smollm2_gguf_path) == ({}, "")  # the default model has none
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_float32("general.sampling.temp", 0.7)
    w.add_int32("general.sampling.top_k", 40)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    values, source = recommended_sampling(path)
    assert values == {"temperature": pytest.approx(0.7), "top_k": 40} and source == path
