r"""What SDP4Bit buys on the paper's own speed-test setups, predicted by the performance model.

  python -m experiments.sdp4bit_speedup                       # record + plot in results/
  python -m experiments.sdp4bit_speedup --gpus=128 --node_gbps=100,400,1600

For each setup of the paper's speed test that we could read (model, cluster kind, GPU count)
the model predicts one iteration with the data-parallel collectives as the speed test's baseline
runs them (Megatron-LM's distributed optimizer: NCCL's ring reduce-scatter of fp32 gradients and
all-gather of bf16 weights, `dp_comm=none`, `perf/comm.ring_link`) and with SDP4Bit's
(`perf/dp_comm.py`; bit widths from `config.SDP4BitConfig`), over the inter-node bandwidths such
a cluster plausibly has, and reports where the speedup can and cannot reach the paper's
headline, "up to 4.08x end-to-end on 128 GPUs" (arXiv 2410.15526, abstract).

What we read, and from where (`SOURCES`):
* models, tensor/pipeline sizes, GPUs per node, accumulation step 1: the README of the official
  repository (jindajia/SDP4Bit ReadME.md, "Speed Test Results Reproduce"); 2.7B's, 13B's and
  18B's shapes from the authors' scripts (`MODELS`); micro-batch 1 and global batch = data-
  parallel size, sequence 2048, selective recomputation, Megatron's distributed optimizer, no
  --overlap-grad-reduce/--overlap-param-gather and no --use-flash-attn: the speed test's
  baseline scripts as kept in hpdps-group/SDP4Bit (wyf_profile/12_23_meeting/orinal_script/
  {2_7B,6_7B}_Baseline.sh, wandb project "NeurIPS-Speed").
What we could NOT read: the per-setup throughputs and speedups (only an image in the README,
Figures/speed_test_table.png), the GPU counts of each row (the README says up to 128; we take
16-128) and the clusters' networks. So `CLUSTERS` are assumptions, each with its source, and
the comparison is with the headline only.
"""
import dataclasses

from absl import app, flags

from experiments.results import write_record
from mscale_jax.errors import ConfigError
from mscale_jax.perf import (A100_MEGASCALE, H800_DGX, Layout, ModelSpec, Techniques, dp_comm,
                             predict)
from mscale_jax.perf.compressed import DPCompression

PAPER_HEADLINE = 4.08          # "up to 4.08x speedup in end-to-end throughput on 128 GPUs"
HEADLINE_GPUS = 128
VOCAB = 50304                  # GPT-2's 50,257 tokens padded to a multiple of 128 (Megatron)
SEQ = 2048
_CARDS = "jindajia/Megatron-LM sample_scripts/icml-performance-bytedance/model-cards/"
SOURCES = {
    "1.3B": "jindajia/SDP4Bit ReadME.md model card",
    "2.7B": "hpdps-group/SDP4Bit wyf_profile/12_23_meeting/orinal_script/2_7B_Baseline.sh",
    "6.7B": "jindajia/SDP4Bit ReadME.md model card",
    "13B": _CARDS + "13B.sh (layers, hidden, heads; its sequence 4096 is a later test's)",
    "18B": _CARDS + "18B.sh (layers, hidden, heads; its sequence 4096 is a later test's)",
}
MODELS = {name: ModelSpec(name, num_layers=layers, hidden=hidden, num_heads=heads,
                          seq_len=SEQ, vocab=VOCAB)
          for name, layers, hidden, heads in (("1.3B", 24, 2048, 16), ("2.7B", 32, 2560, 32),
                                              ("6.7B", 32, 4096, 32), ("13B", 40, 5120, 40),
                                              ("18B", 40, 6144, 48))}
# (tp, pp) per cluster kind: the README's speed-test table.
PARALLEL = {"h800": {"1.3B": (1, 1), "2.7B": (1, 1), "6.7B": (4, 1), "13B": (8, 1),
                     "18B": (8, 1)},
            "a100": {"1.3B": (1, 1), "2.7B": (1, 1), "6.7B": (4, 1), "13B": (4, 2),
                     "18B": (4, 2)}}


@dataclasses.dataclass(frozen=True)
class Cluster:
  """One cluster kind: the node we assume and the inter-node bandwidths it plausibly has."""
  hardware: object
  plausible_gbps: tuple        # (low, high) Gb/s per node and direction
  assumed: str                 # every parameter we assumed, and where it comes from


CLUSTERS = {
    "h800": Cluster(
        H800_DGX, (200.0, 3200.0),
        "8 H800 SXM per node (the README). H800 = H100 SXM compute and HBM3 (989 TFLOP/s "
        "bf16, 3.35 TB/s, 80 GB) with NVLink cut to 400 GB/s bidirectional (200 GB/s per "
        "direction per GPU): the H800_DGX preset. Network not given: from one 200 Gb/s NIC "
        "per node to the DGX H100 reference design's eight 400 Gb/s ConnectX-7 (3,200 Gb/s)."),
    "a100": Cluster(
        dataclasses.replace(A100_MEGASCALE, name="a100_4gpu", devices_per_node=4,
                            nics_per_node=4),
        (100.0, 800.0),
        "4 A100 SXM per node (the README). A100 SXM4 80GB (312 TFLOP/s bf16, 2,039 GB/s; the "
        "40 GB part has 1,555 GB/s), NVLink 3 fully connecting the four (12 links, 300 GB/s "
        "per direction per GPU). Network not given: from one 100 Gb/s NIC per node to four "
        "200 Gb/s NICs (NERSC Perlmutter's GPU nodes: 4 A100 and 4 HPE Slingshot 11 NICs)."),
}
# What the baseline scripts run: no flash attention, no TP-communication or DP overlap, no
# host stalls (mock data). Flash attention (efficient_ops) is a sensitivity in the record.
TECHNIQUES = Techniques(async_data=True)
RECOMPUTE = "selective"


def layout(model: str, cluster: str, gpus: int) -> Layout:
  """The README's TP/PP, accumulation step 1 and micro-batch 1: global batch = DP size."""
  tp, pp = PARALLEL[cluster][model]
  if gpus % (tp * pp) or gpus < tp * pp:
    raise ConfigError("gpus", gpus, f"a multiple of tp*pp={tp * pp} for {model} on {cluster}")
  dp = gpus // (tp * pp)
  return Layout(tp=tp, pp=pp, vpp=1, dp=dp, micro_batch=1, global_batch=dp)


def speedup(model: str, cluster: str, gpus: int, node_gbps: float,
            tech: Techniques = TECHNIQUES) -> dict:
  """Predicted baseline (NCCL's rings) and SDP4Bit iterations of one setup at `node_gbps`.

  Also the uncompressed two-level schedule (`two_level_s`): SDP4Bit's without quantization. It
  equals the baseline where one data-parallel rank sits in each node (TP filling it) and is
  slower where several do (the ring pipelines its intra- and inter-node links; the two levels
  run one after the other), so `speedup_over_two_level` is the codes' gain alone.
  """
  spec = CLUSTERS[cluster]
  hw = dp_comm.at_node_gbps(spec.hardware, node_gbps)
  lay = layout(model, cluster, gpus)
  cmp = dp_comm.compare(MODELS[model], lay, tech, hw, recompute=RECOMPUTE)
  two_level = predict(MODELS[model], lay, dataclasses.replace(
      tech, dp_compression=DPCompression.uncompressed()), hw, recompute=RECOMPUTE).iteration_s
  low, high = spec.plausible_gbps
  return {"baseline_s": cmp.none.iteration_s, "sdp4bit_s": cmp.sdp4bit.iteration_s,
          "speedup": cmp.speedup, "baseline_dp_share": cmp.dp_share,
          "two_level_s": two_level, "speedup_over_two_level": two_level / cmp.sdp4bit.iteration_s,
          "fits": cmp.none.fits, "plausible": low <= node_gbps <= high}


def sweep(gpus_list, gbps_list, tech: Techniques = TECHNIQUES) -> list:
  """One row per (cluster, model, GPU count, bandwidth)."""
  return [{"cluster": cluster, "model": model, "gpus": gpus, "node_gbps": gbps,
           **speedup(model, cluster, gpus, gbps, tech)}
          for cluster in CLUSTERS for model in MODELS for gpus in gpus_list
          for gbps in gbps_list]


def summarize(rows: list) -> dict:
  """Per cluster: the speedup range within its plausible bandwidths at 128 GPUs (or the
  largest count swept), and the highest bandwidth at which any setup reaches the headline."""
  out = {}
  for cluster in CLUSTERS:
    mine = [r for r in rows if r["cluster"] == cluster]
    top = max(r["gpus"] for r in mine)
    at = [r for r in mine if r["gpus"] == top and r["plausible"]]
    reach = [r for r in mine if r["speedup"] >= PAPER_HEADLINE]
    pick = lambda r: None if r is None else {k: r[k] for k in ("model", "gpus", "node_gbps",
                                                                "speedup")}
    out[cluster] = {
        "gpus": top, "plausible_gbps": list(CLUSTERS[cluster].plausible_gbps),
        "min_in_range": pick(min(at, key=lambda r: r["speedup"]) if at else None),
        "max_in_range": pick(max(at, key=lambda r: r["speedup"]) if at else None),
        "headline_reached_in_range": any(r["speedup"] >= PAPER_HEADLINE for r in at),
        "highest_gbps_reaching_headline": pick(
            max(reach, key=lambda r: (r["node_gbps"], r["speedup"])) if reach else None),
        "max_anywhere": pick(max(mine, key=lambda r: r["speedup"]))}
  return out


def implied_gbps(cluster: str, gpus: int = HEADLINE_GPUS, tech: Techniques = TECHNIQUES,
                 target: float = PAPER_HEADLINE) -> dict:
  """The inter-node bandwidth at which the best of the cluster's setups at `gpus` GPUs is
  predicted to speed up by exactly `target`: the network the headline implies, if the model
  is right (bisection in log bandwidth; the speedup falls as the bandwidth grows)."""
  best = lambda g: max((speedup(m, cluster, gpus, g, tech)["speedup"], m) for m in MODELS)
  low, high = 1.0, 1e5
  if best(low)[0] < target or best(high)[0] > target:
    return {"node_gbps": None, "model": None}
  for _ in range(60):
    mid = (low * high) ** 0.5
    low, high = (mid, high) if best(mid)[0] >= target else (low, mid)
  reached, model = best(low)
  return {"node_gbps": low, "model": model, "speedup": reached}


def plot(path: str, rows: list) -> None:
  """Top: speedup against bandwidth at the largest GPU count, one line per model, the plausible
  range shaded, the headline dashed. Bottom: speedup against GPUs at the range's low end."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(2, len(CLUSTERS), figsize=(6 * len(CLUSTERS), 8.4), squeeze=False)
  for col, (cluster, spec) in enumerate(CLUSTERS.items()):
    mine = [r for r in rows if r["cluster"] == cluster]
    top = max(r["gpus"] for r in mine)
    low, high = spec.plausible_gbps
    ax = axes[0][col]
    ax.axvspan(low, high, color="0.9", label="plausible network")
    for model in MODELS:
      pts = sorted((r["node_gbps"], r["speedup"]) for r in mine
                   if r["model"] == model and r["gpus"] == top)
      ax.plot(*zip(*pts), "-o", ms=3, label=model)
    ax.set_xscale("log")
    ax.set_xlabel("inter-node Gb/s per node")
    ax.set_title(f"{cluster}: {top} GPUs", fontsize=10)
    ax = axes[1][col]
    near = min({r["node_gbps"] for r in mine}, key=lambda g: abs(g - low))
    for model in MODELS:
      pts = sorted((r["gpus"], r["speedup"]) for r in mine
                   if r["model"] == model and r["node_gbps"] == near)
      ax.plot(*zip(*pts), "-o", ms=3, label=model)
    ax.set_xscale("log", base=2)
    counts = sorted({r["gpus"] for r in mine})
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_title(f"{cluster}: {near:g} Gb/s per node (low end of its range)", fontsize=10)
    for ax in axes[:, col]:
      ax.axhline(PAPER_HEADLINE, ls="--", color="k", lw=1, label="paper: up to 4.08x")
      ax.set_ylabel("predicted SDP4Bit speedup")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _numbers(values: list, name: str, cast) -> list:
  try:
    out = [cast(v) for v in values]
  except ValueError as e:
    raise ConfigError(name, values, "comma-separated positive numbers") from e
  if not out or any(v <= 0 for v in out):
    raise ConfigError(name, values, "comma-separated positive numbers")
  return out


def define_flags() -> None:
  """Defines the CLI flags (only when run as a script, so importing defines none)."""
  flags.DEFINE_list("gpus", ["16", "32", "64", "128"], "GPU counts to predict.")
  flags.DEFINE_list("node_gbps", ["25", "50", "100", "200", "400", "800", "1600", "3200"],
                    "Inter-node bandwidth per node, Gb/s per direction (all NICs).")
  flags.DEFINE_string("out_dir", None, "Folder for the record and plot (default results/).")


def main(argv):
  del argv
  import os
  import sys
  f = flags.FLAGS
  try:
    gpus, gbps = _numbers(f.gpus, "gpus", int), _numbers(f.node_gbps, "node_gbps", float)
    rows = sweep(gpus, gbps)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  summary = summarize(rows)
  flash_tech = dataclasses.replace(TECHNIQUES, efficient_ops=True)
  flash = summarize(sweep(gpus, gbps, flash_tech))
  for cluster in CLUSTERS:
    summary[cluster]["implied_gbps_for_headline"] = implied_gbps(cluster)
    flash[cluster]["implied_gbps_for_headline"] = implied_gbps(cluster, tech=flash_tech)
  print(f"{'cluster':7} {'model':5} {'GPUs':>5} {'Gb/s/node':>9} {'speedup':>8} {'DP share':>9} "
        f"{'vs 2-level':>10}")
  for r in rows:
    mark = "" if r["plausible"] else "  (outside the plausible range)"
    print(f"{r['cluster']:7} {r['model']:5} {r['gpus']:5d} {r['node_gbps']:9g} "
          f"{r['speedup']:8.2f} {r['baseline_dp_share']:9.1%} "
          f"{r['speedup_over_two_level']:10.2f}{mark}")
  for cluster, s in summary.items():
    lo, hi, reach, implied = (s["min_in_range"], s["max_in_range"],
                              s["highest_gbps_reaching_headline"], s["implied_gbps_for_headline"])
    print(f"[sdp4bit_speedup] {cluster}, {s['gpus']} GPUs, {s['plausible_gbps'][0]:g}-"
          f"{s['plausible_gbps'][1]:g} Gb/s per node: {lo['speedup']:.2f}x ({lo['model']} at "
          f"{lo['node_gbps']:g}) to {hi['speedup']:.2f}x ({hi['model']} at {hi['node_gbps']:g}); "
          + ("4.08x reached at no swept bandwidth" if reach is None else
             f"4.08x reached up to {reach['node_gbps']:g} Gb/s ({reach['model']}, "
             f"{reach['gpus']} GPUs)")
          + ("" if implied["node_gbps"] is None else
             f"; the headline implies {implied['node_gbps']:.0f} Gb/s per node "
             f"({implied['model']})"))
  path = write_record("sdp4bit_speedup", {"rows": rows, "summary": summary},
                      out_dir=f.out_dir, device={"platform": "model"}, extra={
      "paper_headline_speedup": PAPER_HEADLINE, "headline_gpus": HEADLINE_GPUS,
      "setup": {"seq_len": SEQ, "micro_batch": 1, "accumulation_steps": 1,
                "global_batch": "data-parallel size", "recompute": RECOMPUTE,
                "techniques": dataclasses.asdict(TECHNIQUES), "parallel": PARALLEL,
                "models": {k: dataclasses.asdict(v) for k, v in MODELS.items()},
                "compression": dataclasses.asdict(DPCompression()),
                "baseline": "NCCL ring reduce-scatter (fp32) and all-gather (bf16) over the "
                            "data-parallel group (dp_comm=none, perf/comm.ring_link)",
                "two_level": dataclasses.asdict(DPCompression.uncompressed())},
      "clusters": {k: {"assumed": v.assumed, "plausible_gbps": list(v.plausible_gbps),
                       "devices_per_node": v.hardware.devices_per_node,
                       "intra_node_GBps": v.hardware.intra_node_bw / 1e9,
                       "hbm_GBps": v.hardware.hbm_bw / 1e9} for k, v in CLUSTERS.items()},
      "sensitivity_flash_attention": flash,
      "sources": {"models": SOURCES, "parallel": "jindajia/SDP4Bit ReadME.md speed-test table",
                  "batch_recompute_overlap": "hpdps-group/SDP4Bit wyf_profile/12_23_meeting/"
                                             "orinal_script/{2_7B,6_7B}_Baseline.sh",
                  "headline": "arXiv 2410.15526 abstract"},
      "not_read": "the per-setup throughputs and speedups (README image "
                  "Figures/speed_test_table.png), each row's GPU count, the clusters' networks"})
  png = os.path.splitext(path)[0] + ".png"
  plot(png, rows)
  print(f"wrote {path}\nwrote {png}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
