import json

from megacpp_lab.cli import main
from megacpp_lab.data import load_sample


def test_cli_data_writes_sample_and_manifest(tmp_path, capsys):
    assert main(["data", "--out", str(tmp_path), "--rows", "3", "--seq-len", "256", "--quiet"]) == 0
    rows, manifest = load_sample(tmp_path)
    assert rows.batch.tokens.shape == (3, 256)
    assert "3 rows x 256 tokens" in capsys.readouterr().out
    assert manifest["config"]["rows"] == 3


def test_cli_info_prints_stamp(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"device", "torch", "triton", "commit", "date", "device_slug", "scale"} <= info.keys()
