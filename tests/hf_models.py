"""Hugging Face transformers models as a user builds them: from a small config, random weights,
nothing downloaded (GPT-2, BERT, ViT), with samples of their named inputs and a loss of their
``ModelOutput``."""

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, ViTConfig, ViTModel

NAMES = ("gpt2", "bert", "vit")
TOKENS = 8
VOCAB = 64
WIDTH = 32


def make(name):
    """The model, in training mode (its dropout on), with the same weights on every call."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = GPT2Config(
            n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        return GPT2Model(config)
    if name == "bert":
        config = BertConfig(
            num_hidden_layers=2,
            hidden_size=WIDTH,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=16,
        )
        return BertModel(config)
    config = ViTConfig(
        num_hidden_layers=2, hidden_size=WIDTH, num_attention_heads=2, intermediate_size=64, image_size=16, patch_size=4
    )
    return ViTModel(config)


def samples(name, n):
    """``n`` samples of ``name``'s inputs, each a dict of named tensors, and a target for each."""
    generator = torch.Generator().manual_seed(1)
    xs, ys = [], []
    for _ in range(n):
        if name == "vit":
            xs.append({"pixel_values": torch.randn(1, 3, 16, 16, generator=generator)})
            ys.append(torch.randn(1, 17, WIDTH, generator=generator))
            continue
        sample = {"input_ids": torch.randint(0, VOCAB, (1, TOKENS), generator=generator)}
        if name == "bert":  # a padded sequence: its last two tokens are masked
            sample["attention_mask"] = torch.tensor([[1] * (TOKENS - 2) + [0, 0]])
        xs.append(sample)
        ys.append(torch.randn(1, TOKENS, WIDTH, generator=generator))
    return xs, ys


def outputs_of(model, x):
    """What ``model(**x)`` returns as partime streams it: a cache is never asked for."""
    return model(**x, use_cache=False) if isinstance(model, GPT2Model) else model(**x)


def hidden_loss(out, y):
    """The last hidden state against ``y``, and every other tensor of the output kept small."""
    loss = F.mse_loss(out.last_hidden_state, y)
    for key, value in out.items():
        if key != "last_hidden_state":
            loss = loss + value.pow(2).mean()
    return loss


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)
