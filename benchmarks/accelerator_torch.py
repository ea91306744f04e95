"""The PyTorch peer of the accelerator check of issue 36 (`benchmarks/accelerator_check.py`):
the step part's presets, synthetic batches, FLOP count and timing (`accelerator_step.py`) for
`nn.Transformer(d, h, L, L, d_ff, dropout, batch_first=True)` with sinusoidal positions, one
embedding tied to the output projection, padding and causal masks, bfloat16 autocast, fused
Adam on the paper's schedule and label smoothing 0.1; eager, then `torch.compile` (forward and
loss); and torch.matmul's bfloat16 peak.

torch is imported in the torch worker's process only (and the warmers'): where it is missing,
the part records a note instead.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from benchmarks.accelerator_common import (
    STEP_SHAPES,
    Results,
    brief,
    running_record,
    say,
    seconds_left,
)
from benchmarks.accelerator_step import step_flops, step_timing, synthetic_batch


def torch_worker(settings: dict[str, Any], deadline: float, results: Results) -> None:
    try:
        import torch
    except ImportError as error:
        results.data["torch"] = {"skipped": f"torch is not installed ({error})"}
        results.save()
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    record: dict[str, Any] = {"torch": torch.__version__, "device": device,
                              "device_name": torch.cuda.get_device_name(0)
                              if device == "cuda" else "cpu", "eager": {}, "compile": {}}
    results.data["torch"] = record
    record["matmul_peak"] = torch_matmul_peak(torch, device, settings["matmul_sizes"],
                                              settings["matmul_flops"])
    results.save()
    say(f"torch {torch.__version__} on {record['device_name']}: matmul peak "
         f"{record['matmul_peak']['tflops_per_second']:.1f} TFLOP/s")
    for mode, preset in torch_plan(settings):
        needed = settings["min_seconds_per_preset"] * (2 if mode == "compile" else 1)
        if seconds_left(deadline) < needed:
            record[mode][preset] = {"skipped": "time budget"}
            results.save()
            continue
        say(f"torch {mode} {preset} ...")
        record[mode][preset] = running_record()
        results.save()
        try:
            record[mode][preset] = torch_step(torch, device, preset, mode == "compile",
                                              settings)
        except Exception as error:  # noqa: BLE001 (recorded, and the next one runs)
            record[mode][preset] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
        if device == "cuda":
            torch.cuda.empty_cache()
        results.save()
        say(f"torch {mode} {preset}: {brief(record[mode][preset])}")


def torch_plan(settings: dict[str, Any]) -> list[tuple[str, str]]:
    """(mode, preset) in the order the peer runs them: preset by preset, in the order of
    `torch_compile_presets` (base first: the issue's comparison), each eager then compiled,
    so that a budget that runs out leaves the least important ones (small) out."""
    plain = [p for p in settings["presets"] if "+" not in p]  # candidates are ours alone
    order = [*settings["torch_compile_presets"],
             *(p for p in plain if p not in settings["torch_compile_presets"])]
    plan = []
    for preset in order:
        if "eager" in settings["torch_modes"] and preset in plain:
            plan.append(("eager", preset))
        if "compile" in settings["torch_modes"] and preset in settings["torch_compile_presets"]:
            plan.append(("compile", preset))
    return plan


def torch_matmul_peak(torch, device: str, sizes: list[int], flops: float,
                      repeats: int = 5) -> dict[str, Any]:
    """`jax_matmul_peak` through torch.matmul."""
    results = {}
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        calls = max(1, min(50, int(flops // (2 * size**3))))
        torch.matmul(a, b)
        times = []
        for _ in range(repeats):
            _sync(torch, device)
            start = time.perf_counter()
            for _ in range(calls):
                torch.matmul(a, b)
            _sync(torch, device)
            times.append(time.perf_counter() - start)
        results[str(size)] = 2.0 * size**3 * calls / statistics.median(times) / 1e12
    best = max(results, key=results.get)
    return {"tflops_per_second": results[best], "best_size": int(best),
            "by_size_tflops_per_second": results, "dtype": "bfloat16", "through": "torch.matmul"}


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def torch_peer(torch, vocab_size: int, d_model: int, num_heads: int, num_layers: int,
               d_ff: int, dropout: float, max_length: int = 1024):
    """The peer model: nn.Transformer with sinusoidal positions and one embedding shared by
    source, target and the output projection (scaled by sqrt(d_model) at the input)."""
    nn = torch.nn

    class Peer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab_size, d_model)
            nn.init.normal_(self.embedding.weight, std=d_model**-0.5)
            self.transformer = nn.Transformer(d_model, num_heads, num_layers, num_layers, d_ff,
                                              dropout, batch_first=True)
            self.dropout = nn.Dropout(dropout)
            position = torch.arange(max_length, dtype=torch.float32)[:, None]
            rate = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                             * (-math.log(10000.0) / d_model))
            table = torch.zeros(max_length, d_model)
            table[:, 0::2] = torch.sin(position * rate)
            table[:, 1::2] = torch.cos(position * rate)
            self.register_buffer("positions", table, persistent=False)

        def embed(self, ids):
            return self.dropout(self.embedding(ids) * d_model**0.5
                                + self.positions[: ids.shape[1]])

        def forward(self, source, target):
            length = target.shape[1]
            causal = torch.triu(torch.ones(length, length, dtype=torch.bool,
                                           device=target.device), diagonal=1)
            source_padding, target_padding = source == 0, target == 0
            hidden = self.transformer(
                self.embed(source), self.embed(target), tgt_mask=causal,
                src_key_padding_mask=source_padding, tgt_key_padding_mask=target_padding,
                memory_key_padding_mask=source_padding, tgt_is_causal=True)
            return hidden @ self.embedding.weight.t()

    return Peer()


def torch_step(torch, device: str, preset: str, compiled: bool,
               settings: dict[str, Any]) -> dict[str, Any]:
    """The peer's training step on the synthetic batch of `preset`: median step time."""
    import warnings

    from keras_transformer.model.config import transformer_config

    functional = torch.nn.functional
    batch, source_length, target_length, vocab_size = STEP_SHAPES[preset]
    config = transformer_config(preset, vocab_size=vocab_size)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested-tensor notes of nn.TransformerEncoder
        model = torch_peer(torch, vocab_size, config.d_model, config.num_heads,
                           config.num_layers, config.d_ff, config.dropout).to(device)
    model.train()
    try:
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9,
                                     fused=True)
        fused = True
    except (RuntimeError, ValueError):  # a device without the fused kernel
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        fused = False
    warmup = 4000

    def rate(step: int) -> float:  # the paper's schedule, as paper_adam (scale 1)
        step = max(step + 1, 1)
        return config.d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    features, labels = synthetic_batch(batch, source_length, target_length, vocab_size)
    source = torch.as_tensor(features["source"], dtype=torch.long, device=device)
    target = torch.as_tensor(features["target"], dtype=torch.long, device=device)
    label = torch.as_tensor(labels, dtype=torch.long, device=device)

    def loss_of(source, target, label):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = model(source, target)
        return functional.cross_entropy(logits.float().reshape(-1, vocab_size),
                                        label.reshape(-1), ignore_index=0,
                                        label_smoothing=0.1)

    forward = torch.compile(loss_of) if compiled else loss_of

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = forward(source, target, label)
        loss.backward()
        optimizer.step()
        schedule.step()
        return loss

    window = settings["window"]
    windows = max(1, settings["steps"] // window)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first_loss = float(step())
    first_step = time.perf_counter() - start
    for _ in range(window):  # warm-up window
        step()
    window_seconds = []
    for _ in range(windows):
        _sync(torch, device)
        start = time.perf_counter()
        for _ in range(window):
            loss = step()
        _sync(torch, device)
        window_seconds.append(time.perf_counter() - start)
    flops = step_flops(preset, batch, source_length, target_length, vocab_size)
    last_loss = float(loss)
    return {"preset": preset, "mode": "torch.compile" if compiled else "eager",
            "batch": batch, "source_length": source_length, "target_length": target_length,
            "vocab_size": vocab_size, "dropout": config.dropout,
            "parameters": sum(p.numel() for p in model.parameters()),
            "precision": "bfloat16 autocast", "fused_adam": fused,
            "first_step_seconds": first_step, "window": window,
            "timed_steps": window * windows,
            **step_timing(window_seconds, window, batch, target_length, flops),
            "loss_first_step": first_loss, "loss_last_window": last_loss,
            "finite": math.isfinite(first_loss) and math.isfinite(last_loss)}
