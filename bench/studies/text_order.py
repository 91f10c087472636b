"""Does the tiny model's conditioning carry word order? Train on renders and watch the order measure.

Not the product: a check for choosing the next base. The measure: the model's mean prediction of the clean
image from pure noise (64 noises, s = 1, ``x - s v``) for two mirrored prompts ("a red circle left of a
green square" / "a green square left of a red circle", and a right-of pair), the difference in redness
(red minus the mean of green and blue, pixels in [-1, 1]) between the image's left and right halves, signed
so that the renders' own value is +0.72; 0 = the order is ignored. Colour: the mean redness of two red
objects minus two green ones, for scale.

    python -m bench.studies.text_order --encoder clip --steps 1500 --threads 1          # from scratch
    python -m bench.studies.text_order --init data/base --kinds all --steps 2000        # continue the base

Training: pretraining's ``flow_loss`` and ``lr_at`` on batches of 64 training prompts of ``--kinds`` rendered
on the fly, noise levels ``sigmoid(N(--noise-mean, 1))`` (layouts form at high noise), 10% empty prompts,
AdamW (5% warm-up, cosine to a tenth), the transformer and the text encoder trained together; the measure
every 500 steps, no EMA.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

PAIRS = (("a red circle left of a green square", "a green square left of a red circle", 1),
         ("a red square right of a blue circle", "a blue circle right of a red square", -1))


def build(args):
    """(backend, encode(prompts) -> (hidden, pooled), trainable parameters)."""
    from tpgrpo.models import load_backend
    from tpgrpo.models.tiny import TinyConfig, build_tiny
    from tpgrpo.models.tokenizer import tokenize

    b = load_backend("tiny", args.init) if args.init else build_tiny(TinyConfig(), seed=args.seed)
    text = b.text_encoder
    if args.encoder == "t5":  # bidirectional, as SD3's third encoder; mean-pooled for the pooled input
        from transformers import T5Config, T5EncoderModel

        text = T5EncoderModel(T5Config(vocab_size=len(b.tokenizer), d_model=128, d_kv=32, d_ff=512, num_layers=2,
                                       num_heads=4, dropout_rate=0.0, feed_forward_proj="gated-gelu", pad_token_id=0))

    def encode(prompts):
        ids = tokenize(b.tokenizer, prompts, b.config.max_length)
        if args.encoder == "t5":
            mask = (ids != 0).long()
            h = text(input_ids=ids, attention_mask=mask).last_hidden_state
            return h, (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        out = text(input_ids=ids)
        return out.last_hidden_state, out.pooler_output

    b.encode_text = encode  # what pretraining's flow_loss encodes with
    return b, encode, list(b.transformer.parameters()) + list(text.parameters())


def order_measure(b, encode) -> dict:
    """The signed left-right redness difference per mirrored pair (+0.72 = the renders'), and colour."""
    import torch

    n = 64
    z = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def mean_x0(prompt):
        h, pooled = encode([prompt] * n)
        return (z - b.predict(z, torch.ones(n), h, pooled)).mean(0)

    def red(m):
        return m[0] - m[1:].mean(0)

    with torch.no_grad():
        order = []
        for a, c, sign in PAIRS:
            d = red(mean_x0(a)) - red(mean_x0(c))
            order.append(round(sign * float(d[:, :16].mean() - d[:, 16:].mean()), 4))
        colour = float((red(mean_x0("a red circle left of a red square"))
                        - red(mean_x0("a green circle left of a green square"))).mean())
    return {"order": order, "colour": round(colour, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoder", choices=["clip", "t5"], default="clip")
    ap.add_argument("--init", default="", help="a tiny model folder to continue (default: from scratch)")
    ap.add_argument("--kinds", default="position", help="prompt kinds trained on, comma-separated, or all")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise-mean", type=float, default=1.5, help="mean of the logit-normal noise levels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", default="", help="save the model here at every measure (folder-STEP)")
    args = ap.parse_args()

    import torch

    from tpgrpo.models.pretrain import flow_loss, lr_at
    from tpgrpo.tasks.prompts import build_prompt_sets
    from tpgrpo.tasks.render import render_prompt

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    b, encode, params = build(args)
    kinds = args.kinds.split(",")
    pool = [m for m in build_prompt_sets(seed=0)["compositional_train"] if "all" in kinds or m["kind"] in kinds]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    rng, gen = np.random.default_rng(args.seed), torch.Generator().manual_seed(args.seed)
    start = time.time()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step / args.steps, args.lr, 0.05)
        metas = [pool[int(rng.integers(len(pool)))] for _ in range(64)]
        x0 = b.encode_images(np.stack([render_prompt(m, rng) for m in metas]))
        loss = flow_loss(b, x0, [m["prompt"] for m in metas], gen, dropout=0.1, noise_mean=args.noise_mean)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 500 == 0 or step == args.steps:
            print(f"step {step} loss {loss.item():.4f} {time.time() - start:.0f} s: {order_measure(b, encode)}",
                  flush=True)
            if args.save:
                b.save_pretrained(f"{args.save}-{step}")


if __name__ == "__main__":
    main()
