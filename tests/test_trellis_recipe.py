"""`mlxd quantize`'s recipe: the defaults, a TOML or JSON file that changes some of them, and a
clear error (the file and the key) for unknown keys and bad values; the CLI stays short."""

from __future__ import annotations

import json

import pytest

from mlxd.quantize import (
    BlockTuning,
    Calibration,
    Finetuning,
    Recipe,
    RecipeError,
    build_parser,
    load_recipe,
    main,
    recipe_from_dict,
    recipe_toml,
)


def test_printed_defaults_read_back_as_the_defaults(tmp_path, capsys):
    assert main(["--print-recipe"]) == 0
    path = tmp_path / "r.toml"
    path.write_text(capsys.readouterr().out)
    assert load_recipe(path) == Recipe()
    assert recipe_toml() == path.read_text()


def test_a_file_changes_only_the_keys_it_sets(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text('L = 8\nskip = ["lm_head", "gate_proj"]\n[finetune]\nsteps = 3\nlr = 2e-3\n'
                    '[block_tune]\ntarget = "own"\n')
    want = Recipe(L=8, skip=("lm_head", "gate_proj"), finetune=Finetuning(steps=3, lr=2e-3),
                  block_tune=BlockTuning(target="own"))
    assert load_recipe(toml) == want
    js = tmp_path / "r.json"
    js.write_text(json.dumps({"L": 8, "skip": ["lm_head", "gate_proj"], "finetune": {"steps": 3, "lr": 2e-3},
                              "block_tune": {"target": "own"}}))
    assert load_recipe(js) == want
    assert recipe_from_dict({"calibration": {"sequential": False, "windows": 2}}) == Recipe(
        calibration=Calibration(windows=2, sequential=False))
    assert recipe_from_dict({"finetune": {"lr": 1}}).finetune.lr == 1.0  # an int where a float goes
    assert recipe_from_dict({"L": None}) == Recipe()  # JSON null: the device's default


@pytest.mark.parametrize("data,message", [
    ({"finetune_steps": 3}, "unknown key 'finetune_steps'"),
    ({"finetune": {"step": 3}}, "finetune: unknown key 'step'"),
    ({"finetune": {"lr": "fast"}}, "finetune.lr must be a number, got 'fast'"),
    ({"finetune": {"steps": 1.5}}, "finetune.steps must be an integer"),
    ({"finetune": {"steps": True}}, "finetune.steps must be an integer"),
    ({"finetune": {"signs": 1}}, "finetune.signs must be true or false"),
    ({"finetune": {"lr": -1.0}}, "finetune: lr must be > 0"),
    ({"finetune": {"batch": 0}}, "finetune: batch must be >= 1"),
    ({"block_tune": {"steps": -1}}, "block_tune: steps must be >= 0"),
    ({"block_tune": {"target": "best"}}, "block_tune: target must be one of"),
    ({"block_tune": 16}, "block_tune must be a table"),
    ({"calibration": {"windows": 0}}, "calibration: windows must be >= 1"),
    ({"skip": "lm_head"}, "skip must be a list of strings"),
    ({"code": "2mad"}, "code must be one of 1mad, 3inst"),
    ({"max_block": 100}, "max_block must be one of [32, 64, 128, 256]"),
    ({"L": 20}, "L must be in 5..16"),
    ({"L": "16"}, "L must be an integer"),
])
def test_bad_recipes_name_the_key(data, message):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(data)
    assert message in str(err.value)


def test_cli_refuses_a_bad_recipe_file_before_loading_anything(tmp_path, capsys):
    path = tmp_path / "r.toml"
    path.write_text("[finetune]\nstepz = 3\n")
    with pytest.raises(SystemExit) as err:
        main([str(tmp_path / "missing-model"), str(tmp_path / "out"), "--bits", "3", "--recipe", str(path)])
    assert err.value.code == 2
    assert f"{path}: finetune: unknown key 'stepz'" in capsys.readouterr().err
    path.write_text("[finetune\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "m"), str(tmp_path / "o"), "--bits", "3", "--recipe", str(path)])
    assert str(path) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_needs_bits_and_both_directories(tmp_path, capsys):
    for argv in ([str(tmp_path), str(tmp_path / "o")], ["--bits", "3", str(tmp_path)], ["--bits", "5", "a", "b"]):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2
    assert "invalid choice: 5" in capsys.readouterr().err


def test_help_is_short():
    text = build_parser().format_help()
    assert len(text.splitlines()) <= 25, text
    for research in ("finetune", "block-tune", "trellis-L", "windows"):
        assert research not in text
