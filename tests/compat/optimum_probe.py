"""Run by tests/compat/test_optimum.py in subprocesses (the onnxruntime swap must not leak into other tests).

    python optimum_probe.py export DIR              export tiny random-weight models with optimum
    python optimum_probe.py run DIR ENGINE OUT.npz  run them with optimum on ENGINE ('onnxruntime' or 'carrack')
    python optimum_probe.py export-run DIR OUT.npz  both, on onnxruntime (one process: imports are the slow part)

With ENGINE=carrack the only change is carrack.install_as_onnxruntime() before optimum is imported.
"""

from __future__ import annotations

import os
import sys

import numpy as np

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "fast", "slow", "good", "bad"]


def write_tokenizer(directory: str):
    from transformers import BertTokenizerFast

    os.makedirs(directory, exist_ok=True)
    vocab = os.path.join(directory, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=vocab)
    tokenizer.save_pretrained(directory)
    return tokenizer


def export(root: str) -> None:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM, ORTModelForFeatureExtraction, ORTModelForSequenceClassification
    from transformers import BertConfig, BertForSequenceClassification, BertModel, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    bert = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, num_labels=3)
    # large random weights, so greedy decoding does not just repeat the prompt's last token
    gpt2 = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.6)
    for name, model, ort_class in (("seqcls", BertForSequenceClassification(bert), ORTModelForSequenceClassification),
                                   ("feature", BertModel(bert), ORTModelForFeatureExtraction),
                                   ("causal", GPT2LMHeadModel(gpt2), ORTModelForCausalLM)):
        source, target = os.path.join(root, name + "_torch"), os.path.join(root, name)
        model.eval().save_pretrained(source)
        write_tokenizer(source)
        exported = ort_class.from_pretrained(source, export=True, **({"use_cache": True} if name == "causal" else {}))
        exported.save_pretrained(target)
        write_tokenizer(target)


def run(root: str, engine: str, out: str) -> None:
    if engine == "carrack":
        import carrack

        carrack.install_as_onnxruntime()
    import onnxruntime
    from optimum.onnxruntime import ORTModelForCausalLM, ORTModelForFeatureExtraction, ORTModelForSequenceClassification
    from transformers import AutoTokenizer, pipeline

    results: dict[str, np.ndarray] = {}
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "seqcls"))
    batch = tokenizer(["hello world the cat sat", "a dog ran fast on the mat"], padding=True, return_tensors="np")

    seqcls = ORTModelForSequenceClassification.from_pretrained(os.path.join(root, "seqcls"))
    results["seqcls_logits"] = np.asarray(seqcls(**batch).logits)
    classify = pipeline("text-classification", model=seqcls, tokenizer=tokenizer, top_k=None)
    scores = classify(["the cat sat on the mat", "good dog"])
    results["pipeline_scores"] = np.array([[d["score"] for d in sorted(row, key=lambda d: d["label"])]
                                           for row in scores])

    feature = ORTModelForFeatureExtraction.from_pretrained(os.path.join(root, "feature"))
    results["feature_hidden"] = np.asarray(feature(**batch).last_hidden_state)
    extract = pipeline("feature-extraction", model=feature, tokenizer=tokenizer)
    results["pipeline_features"] = np.asarray(extract("the dog sat"))

    causal = ORTModelForCausalLM.from_pretrained(os.path.join(root, "causal"), use_cache=True)
    assert causal.use_cache, "the decoder was exported without past key values"
    prompt = np.array([[1, 5, 9, 13], [1, 7, 3, 20]], dtype=np.int64)
    import torch

    generated = causal.generate(input_ids=torch.from_numpy(prompt), attention_mask=torch.ones(2, 4, dtype=torch.long),
                                max_new_tokens=8, do_sample=False, pad_token_id=0)
    results["generated"] = np.asarray(generated)
    results["causal_logits"] = np.asarray(causal(input_ids=torch.from_numpy(prompt),
                                                 attention_mask=torch.ones(2, 4, dtype=torch.long)).logits)
    # the IOBinding path (optimum binds torch tensors' memory and preallocated outputs)
    bound = ORTModelForCausalLM.from_pretrained(os.path.join(root, "causal"), use_cache=True, use_io_binding=True)
    results["generated_iobinding"] = np.asarray(bound.generate(
        input_ids=torch.from_numpy(prompt), attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=8,
        do_sample=False, pad_token_id=0))
    bound_cls = ORTModelForSequenceClassification.from_pretrained(os.path.join(root, "seqcls"), use_io_binding=True)
    results["seqcls_logits_iobinding"] = bound_cls(**{k: torch.from_numpy(v) for k, v in batch.items()}).logits.numpy()
    results["engine"] = np.array(onnxruntime.__doc__ or "")
    results["session_class"] = np.array(type(seqcls.model).__module__)
    np.savez(out, **results)


if __name__ == "__main__":
    if sys.argv[1] == "export":
        export(sys.argv[2])
    elif sys.argv[1] == "export-run":
        export(sys.argv[2])
        run(sys.argv[2], "onnxruntime", sys.argv[3])
    else:
        run(sys.argv[2], sys.argv[3], sys.argv[4])
