"""`moeflow generate` against transformers' `generate` (greedy, token for token) for each supported architecture,
with and without the KV cache (MLA's compressed cache for DeepSeek-V3); the CLI on a Hugging Face folder and on a
converted run with a chat template; nucleus sampling; `moeflow eval` against transformers' loss."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from moeflow.cli import main as cli_main  # noqa: E402
from moeflow.generate import eos_ids, generate, pick  # noqa: E402
from moeflow.models.hf import from_pretrained  # noqa: E402
from tests.support.data_fixtures import WORDS  # noqa: E402
from tests.support.hf_models import V, hf_configs, randomize  # noqa: E402

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
NEW = 16
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def _word_tokenizer(folder) -> None:
    """A word-level tokenizer of fewer than V tokens with a chat template, saved beside a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system",
                                         *dict.fromkeys(WORDS)])}
    assert len(vocab) <= V
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                                chat_template=TEMPLATE)
    fast.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (folder, transformers model)} for the tiny configs of tests/models/test_hf.py (random weights)."""
    out = {}
    for i, (name, config) in enumerate(hf_configs().items()):
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(config)
        randomize(hf, seed=10 + i)
        with torch.no_grad():  # tied heads otherwise repeat the last token: greedy output would be one token
            hf.get_input_embeddings().weight.mul_(0.1)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = (folder, hf.eval())
    return out


def test_greedy_equals_transformers_with_and_without_cache(saved):
    prompt = torch.tensor([[40, 90, 88, 20, 72, 41, 65, 43, 39]])
    for name, (folder, hf) in saved.items():
        with torch.no_grad():
            want = hf.generate(prompt, max_new_tokens=NEW, do_sample=False)[0, prompt.shape[1]:].tolist()
        model, _ = from_pretrained(folder)
        model.eval()
        for use_cache in (True, False):
            got = generate(model, prompt[0].tolist(), NEW, use_cache=use_cache, eos=eos_ids(folder))
            assert got == want, (name, use_cache, got, want)
        assert len(set(want)) >= 4, (name, want)  # a real sequence, not one token repeated


def test_nucleus_sampling_keeps_the_top_mass():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    gen = torch.Generator().manual_seed(0)
    draws = [pick(logits, 1.0, 0.7, gen) for _ in range(400)]
    assert set(draws) == {1, 2}  # 0.5 alone is short of 0.7; 0.5 + 0.3 reaches it
    assert 0.55 < draws.count(1) / 400 < 0.7  # renormalised: 0.5 / 0.8 = 0.625
    assert pick(logits, 0.0, 0.7, gen) == 1  # temperature 0: greedy
    again = torch.Generator().manual_seed(0)
    assert [pick(logits, 1.0, 0.7, again) for _ in range(400)] == draws  # --seed makes it reproducible


def test_cli_generate_and_eval(saved, tmp_path, capsys):
    def _cli(*args) -> SimpleNamespace:
        code = cli_main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    folder, hf = saved["qwen3_moe"]
    _word_tokenizer(folder)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    out = _cli("generate", "--hf-path", folder, "--prompt", "the cat sat on", "--temperature", "0",
               "--max-new-tokens", NEW, "--ids")
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout.strip().splitlines()[-1])
    prompt = tok("the cat sat on")["input_ids"]
    assert ids["prompt_ids"] == prompt
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):].tolist()
    assert ids["new_ids"] == want
    assert out.stdout.splitlines()[0] == tok.decode(prompt + want, skip_special_tokens=True)
    assert "tokens/s, KV cache]" in out.stderr

    run = tmp_path / "run"
    assert _cli("convert", "hf-to-moeflow", folder, run).returncode == 0
    out = _cli("generate", "--run-dir", run, "--chat", "how are you ?", "--temperature", "0", "--max-new-tokens",
               NEW, "--ids", "--no-cache")
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout.strip().splitlines()[-1])
    chat = tok.apply_chat_template([{"role": "user", "content": "how are you ?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert ids["prompt_ids"] == tok(chat, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids["prompt_ids"]]), max_new_tokens=NEW, do_sample=False)
    assert ids["new_ids"] == want[0, len(ids["prompt_ids"]):].tolist()

    text = tmp_path / "notes.txt"
    text.write_text(" ".join(WORDS * 3))
    out = _cli("eval", "--hf-path", folder, "--data", text, "--seq-len", 16, "--batch-size", 3, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    stream = tok(text.read_text(), add_special_tokens=False)["input_ids"]
    windows = torch.tensor([stream[i:i + 17] for i in range(0, len(stream) - 16, 16)])
    with torch.no_grad():
        want = F.cross_entropy(hf(windows[:, :-1]).logits.flatten(0, 1), windows[:, 1:].flatten())
    assert result["loss"] == pytest.approx(float(want), rel=1e-5)
    assert result["trained_tokens"] == windows[:, 1:].numel() and result["tokens_per_s"] > 0
    cpu = _cli("eval", "--hf-path", folder, "--data", text, "--seq-len", 16, "--batch-size", 3, "--json",
               "--device", "cpu")  # the CPU also on a machine with a GPU
    assert cpu.returncode == 0, cpu.stderr
    assert json.loads(cpu.stdout)["loss"] == pytest.approx(result["loss"], rel=1e-5)
    if not torch.cuda.is_available():
        for command in (["eval", "--hf-path", folder, "--data", text],
                        ["generate", "--hf-path", folder, "--prompt", "a"]):
            out = _cli(*command, "--device", "cuda")
            assert out.returncode == 2 and "--device = 'cuda' but CUDA is not available" in out.stderr, out.stderr


def test_tokenizer_folder_finds_what_training_found_beside_the_data(tmp_path):
    """data.tokenizer = 'auto' trains with the tokenizer.json beside data.source; generate and eval must use it
    too (not fall back to bytes), and the explicit setting wins over the model's folders."""
    from moeflow.config import JobConfig
    from moeflow.generate import tokenizer_folder

    data, run, origin = tmp_path / "data", tmp_path / "run", tmp_path / "origin"
    for d in (data, run, origin):
        d.mkdir()
    (data / "tokenizer.json").write_text("{}")
    job = JobConfig()
    job.data.source, job.data.tokenizer = str(data / "train.jsonl"), "auto"
    assert tokenizer_folder(job, run, origin) == data
    job.data.tokenizer = "byte"  # nothing to look for beside the data: the model's folders, else none
    assert tokenizer_folder(job, run, origin) is None
    (run / "tokenizer.json").write_text("{}")
    assert tokenizer_folder(job, run, origin) == run
