"""A GPTQ run with its output redirected to a file (CI, nohup): one plain line per layer, with an ETA
that is never blank after the first layer, and a results table whose path is not cut."""
import os
import re
import subprocess
import sys

from tests.helpers import CORPUS, write_hf_dir

LINE = re.compile(r"^quantize: layer (\d+)/3  \d+\.\d s  eta (\S+)  gptq_loss mean \S+$")


def test_gptq_into_a_file_writes_one_line_per_layer_with_an_eta(tmp_path):
    source = tmp_path / "tiny-3-layers"
    write_hf_dir(source, layers=3)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(CORPUS * 10) + "\n")
    out = tmp_path / ("a-long-output-folder-name-" * 3 + "w4")
    log = tmp_path / "quantize.log"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    with log.open("w") as f:  # stdout and stderr into one file, as nohup does
        proc = subprocess.run([sys.executable, "-m", "llmopt.cli.main", "quantize", str(source), "-o", str(out),
                               "--method", "gptq", "--calib", str(calib), "--nsamples", "4", "--seqlen", "32",
                               "--eval-windows", "0"], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text
    layers = [LINE.match(line) for line in text.splitlines() if line.startswith("quantize: layer")]
    assert [m and m.group(1) for m in layers] == ["1", "2", "3"], text
    assert all(re.fullmatch(r"\d+:\d\d:\d\d", m.group(2)) for m in layers), text
    assert "\x1b[" not in text  # no terminal control codes in a log
    assert f"quantized -> {out}" in text  # the path whole, on one line
