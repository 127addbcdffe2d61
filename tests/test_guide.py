"""README's "Choosing a kernel" is generated from the committed outputs it cites (favor.repro.guide)."""

import json
import shutil

from favor.repro import guide

CITED = ["bench/ablation-default.json", "bench/causal-ratios.json", "bench/generate.json",
         "bench/accel-nvidia-h200-segments.json", "bench/accel-nvidia-h200-tuned-causal.json"] + \
        [f"repro/{n}/{n}.json" for n in ("listops-kernels", "uptrain-kernels", "linearize", "mqar-kernels",
                                        "speech-kernels")]


def _copy(tmp_path):
    for rel in CITED + ["README.md"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(guide.ROOT / rel, tmp_path / rel)
    return tmp_path


def test_the_readme_section_is_what_the_committed_outputs_give(capsys):
    assert guide.main(["--check"]) == 0, capsys.readouterr().err


def test_a_changed_measurement_changes_the_guide_and_fails_the_check(tmp_path, capsys):
    root = _copy(tmp_path)
    path = root / "repro/listops-kernels/listops-kernels.json"
    data = json.loads(path.read_text())
    data["figures"]["settings"]["softmax"]["mean"] = 0.5
    path.write_text(json.dumps(data))
    assert guide.main(["--check", "--root", str(root)]) == 1
    assert "not what the committed outputs give" in capsys.readouterr().err
    assert guide.main(["--root", str(root)]) == 0
    assert "| **A task attention decides, from scratch** (ListOps, " in guide.current(root / "README.md")
    assert "softmax 50.0 %" in guide.current(root / "README.md")
    assert guide.main(["--check", "--root", str(root)]) == 0


def test_every_cited_output_is_needed_and_a_missing_one_is_named(tmp_path, capsys):
    for rel in CITED:
        root = _copy(tmp_path / rel.replace("/", "_"))
        (root / rel).unlink()
        assert guide.main(["--check", "--root", str(root)]) == 2, rel
        assert rel.split("/")[-1] in capsys.readouterr().err, rel
