import json, os
import pytest
from gates.prompts import PROMPTS, PromptsError, battery, read_prompts
from model.train import PYTHON_PROMPTS
from model.config import get_config

TINY = get_config("tiny")


def test_a_checkpoint_battery_replaces_the_default(tmp_path):
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": list(PYTHON_PROMPTS)}))
    b = battery(TINY, tmp_path)
    assert b.texts == PYTHON_PROMPTS and len(b.ids) == len(PYTHON_PROMPTS)
    assert b.source.endswith(f"; prompts:{tmp_path / 'prompts.json'}")
    assert battery(TINY, tmp_path, prompts=PROMPTS).texts == PROMPTS  # an explicit battery wins


@pytest.mark.parametrize("content, fault", [
    ('{"prompts": []}', "non-empty texts"), ('{"prompts": ["a", ""]}', "non-empty texts"),
    ('{"prompts": ["a", 3]}', "non-empty texts"), ('["a"]', "expected"),
    ('{"prompts": ["a"], "extra": 1}', "unknown keys"), ('{"prompts": ["a"], "prompts": ["b"]}', "prompts.json"),
    ('{"prompts": ["a"', "prompts.json")])
def test_a_bad_battery_is_refused_by_name(tmp_path, content, fault):
    (tmp_path / "prompts.json").write_text(content)
    with pytest.raises(PromptsError, match=fault):
        battery(TINY, tmp_path)


def test_a_battery_link_out_of_the_folder_is_refused(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"prompts": ["a"]}))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.symlink(outside, folder / "prompts.json")
    with pytest.raises(PromptsError):
        read_prompts(folder)
    assert read_prompts(tmp_path / "nothing-here") is None


def test_text_prompts_without_a_tokenizer_are_refused_by_the_gates_check(tmp_path):
    from gates.prompts import check_prompt_files
    check_prompt_files(tmp_path)   # no prompts.json: nothing to refuse
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": ["a"]}))
    with pytest.raises(PromptsError, match="cannot be tokenised without tiktoken.model"):
        check_prompt_files(tmp_path)
    (tmp_path / "tiktoken.model").write_text("")   # present in any form: the tokenizer's reader judges it
    check_prompt_files(tmp_path)
