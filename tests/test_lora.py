"""LoRA adapters merged at load (eyas.loader.lora). The oracle is PEFT itself: an adapter made and saved by
`peft.get_peft_model`, run by `PeftModel.from_pretrained` on transformers' model, gives the logits eyas gives with
the adapter merged; speculative decoding on the adapted model equals plain decoding; what cannot be merged is a
clear error."""
import json

import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.loader import load_target
from helpers import write_random_draft, write_tiny_llama

VOCAB = 97


def write_adapter(base, path, rslora=False, targets=("q_proj", "v_proj", "down_proj", "gate_proj"), seed=3):
    """A random LoRA adapter of `base`, saved by PEFT (B not zero, so it changes the model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0,
                                            use_rslora=rslora))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft.save_pretrained(path)
    return path


def peft_logits(base, adapter, ids):
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("lora") / "base", vocab=VOCAB, hidden=64, heads=4, kv_heads=2,
                            layers=2, max_pos=256)


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_adapter_equals_peft(base, tmp_path, rslora):
    adapter = write_adapter(base, tmp_path / "a", rslora=rslora)
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = peft_logits(base, adapter, ids)
    model, _ = load_target(str(base), "cpu", "float32", lora=str(adapter))
    got = model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    plain, _ = load_target(str(base), "cpu", "float32")
    assert not torch.allclose(plain.compute_logits(plain(torch.tensor([ids]), torch.arange(len(ids))[None]))[0],
                              ref, atol=1e-2)  # the adapter changed the model


def test_adapted_model_speculates_exactly(base, tmp_path):
    """Greedy output with the adapter merged: the same with speculation (a draft of the base model's shape) as
    without, and HF + PEFT's greedy generate."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    adapter = write_adapter(base, tmp_path / "a")
    draft = write_random_draft(tmp_path / "d", base)
    prompts = [[1, 2, 3, 4], list(range(10, 30))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LLM(str(base), device="cpu", dtype="float32", lora=str(adapter)).generate(prompts, params)
    spec = LLM(str(base), device="cpu", dtype="float32", lora=str(adapter), draft=str(draft),
               speculation="tree:8").generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    hf = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    assert plain[0].token_ids == want


def test_what_cannot_be_merged_is_refused(base, tmp_path):
    adapter = write_adapter(base, tmp_path / "a")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    for change, words in (({"use_dora": True}, "use_dora"), ({"bias": "all"}, "bias"),
                          ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
                          ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                          ({"peft_type": "IA3"}, "not LORA")):
        bad = tmp_path / f"bad_{words}"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        (bad / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=words):
            load_target(str(base), "cpu", "float32", lora=str(bad))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_target(str(base), "cpu", "float32", lora=str(tmp_path))
    other = write_tiny_llama(tmp_path / "other", vocab=VOCAB, hidden=32, heads=4, kv_heads=2, layers=2)
    with pytest.raises(ValueError, match="the adapter's B @ A"):  # an adapter of another model's shapes
        load_target(str(other), "cpu", "float32", lora=str(adapter))
    with pytest.raises(ValueError, match="prefill_process"):
        LLM(str(base), device="cpu", lora=str(adapter), prefill_process=True)
