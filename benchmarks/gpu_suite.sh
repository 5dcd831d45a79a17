#!/usr/bin/env bash
# The GPU benchmark suite in one call (2x H200: single-GPU benchmarks on GPU 0, then the
# 2-process sync-group run and the FSDP tests on both). Results: $OUT (or ./bench-out).
# Usage on the GPU machine, from the repo root: bash benchmarks/gpu_suite.sh [verify,verify2,train,train_ckpt,sync,fsdp,generate,lora,reference,refgen,vae,vae384,vae768,encode,gputests,trainvariants,refgenskip,refgen768,gen768,gen768skip,gen768prof,attention,traingraphs,rowgroups,lowmem,fp8,refgen1,recipe384,graphtests,recipe768,warmupprof,recipe768prof,recipe768rowgroups,recipe768rows,recipe768kernels,trainattention,composetest,rowgrouptests,recipe384warm,recipe384cache,gen2gpu,lowmem768,recipe384graphs,recipe384cpp,steptests]
# (LAYOUTS=channels_last_unfused,channels_last picks the VAE layouts the vae steps time)
# (TRAIN_VARIANTS=efficient,efficient+compile+skip picks the pfctl variants the trainvariants step times)
# (reference: needs a Pyramid-Flow checkout in third_party/Pyramid-Flow and einops; not in the default list)
set -uo pipefail
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS="${1:-verify,train_ckpt,sync,fsdp}"
GPU="${GPU:-0}"  # the GPU of the single-GPU steps (two suites can run side by side: GPU=1 bash ...)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
python -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" | tee -a "$OUT/gpus.txt"
case ",$STEPS," in *,gputests,*)
  echo "=== CUDA-only tests"; CUDA_VISIBLE_DEVICES=$GPU python -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_fast_paths.py 2>&1 | tee -a "$OUT/suite.log" | tail -25;;
esac
case ",$STEPS," in *,verify,*)
  echo "=== verify"; CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_verify.py --device cuda --repeats 2 --json "$OUT/verify.json" 2>&1 | tee -a "$OUT/suite.log" | grep -v "kept in float32" | tail -8;;
esac
case ",$STEPS," in *,train_ckpt,*)
  echo "=== train (gradient checkpointing)"; CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --device cuda --gradient-checkpointing --json "$OUT/train_ckpt.json" 2>&1 | tee -a "$OUT/suite.log" | tail -18;;
esac
case ",$STEPS," in *,sync,*)
  echo "=== sync group (2 GPUs, G=2, miniFLUX 384p)"; python benchmarks/bench_sync_group.py --nproc 2 --group 2 --preset miniflux --json "$OUT/sync.json" 2>&1 | tee -a "$OUT/suite.log" | tail -14;;
esac
case ",$STEPS," in *,fsdp,*)
  echo "=== FSDP tests (2 GPUs)"; python -m pytest -q -n 0 -p no:cacheprovider tests/integration/test_train_fsdp.py 2>&1 | tee -a "$OUT/suite.log" | tail -6;;
esac
case ",$STEPS," in *,generate,*)
  echo "=== generate 5 s 384p (GPU 0): CUDA graphs, then + compiled blocks"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_generate.py --device cuda --json "$OUT/generate.json" 2>&1 | tee -a "$OUT/suite.log" | tail -3
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_generate.py --device cuda --compile --videos 3 --json "$OUT/generate_compile.json" 2>&1 | tee -a "$OUT/suite.log" | tail -3;;
esac
case ",$STEPS," in *,lora,*)
  echo "=== LoRA memory levers (GPU 0)"; CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_lora.py --json "$OUT/lora.json" 2>&1 | tee -a "$OUT/suite.log" | tail -14;;
esac
case ",$STEPS," in *,reference,*)
  echo "=== side by side with the reference (GPU 0, miniFLUX 384p: generate 5 s, train step; then generate with compiled blocks)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_reference.py all --device cuda --reference third_party/Pyramid-Flow --json "$OUT/reference.json" 2>&1 | tee -a "$OUT/suite.log" | tail -16
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_reference.py generate --compile --device cuda --reference third_party/Pyramid-Flow --json "$OUT/reference_compile.json" 2>&1 | tee -a "$OUT/suite.log" | tail -6;;
esac
case ",$STEPS," in *,refgen,*)
  echo "=== generate 5 s 384p side by side with the reference, compiled blocks (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_reference.py generate --compile --device cuda --reference third_party/Pyramid-Flow --json "$OUT/reference_compile.json" 2>&1 | tee -a "$OUT/suite.log" | tail -8;;
esac
case ",$STEPS," in *,refgen768,*)
  echo "=== generate 5 s 768p side by side with the reference, compiled blocks (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_reference.py generate --compile --device cuda --resolution 768p --reference third_party/Pyramid-Flow --json "$OUT/reference_768.json" 2>&1 | tee -a "$OUT/suite.log" | tail -8;;
esac
case ",$STEPS," in *,trainvariants,*)
  echo "=== train step side by side with the reference: pfctl variants (attention kernel, compiled blocks, skip_future_keys) (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_reference.py train --train-variants "${TRAIN_VARIANTS:-efficient,efficient+compile,efficient+compile+skip,cudnn+compile+skip}" --profile --device cuda --reference third_party/Pyramid-Flow --json "$OUT/reference_train_variants.json" 2>&1 | tee -a "$OUT/suite.log" | tail -22;;
esac
case ",$STEPS," in *,attention,*)
  echo "=== masked attention kernels on the DiT's masks (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_attention.py --device cuda --no-flex --json "$OUT/attention.json" 2>&1 | tee -a "$OUT/suite.log" | tail -24;;
esac
case ",$STEPS," in *,refgenskip,*)
  echo "=== generate 5 s 384p side by side with the reference, compiled blocks + skip_future_keys (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_reference.py generate --compile --skip-future-keys --device cuda --reference third_party/Pyramid-Flow --json "$OUT/reference_compile_skip.json" 2>&1 | tee -a "$OUT/suite.log" | tail -8;;
esac
for step in gen768 gen768skip; do
  case ",$STEPS," in *,$step,*)
    flags=(--no-skip-future-keys); [ $step = gen768skip ] && flags=(--skip-future-keys)
    echo "=== generate 5 s 768p, compiled blocks ${flags[*]} (GPU $GPU)"
    CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_generate.py --device cuda --resolution 768p --compile --decode-tile auto --call-times "${flags[@]}" --json "$OUT/$step.json" 2>&1 | tee -a "$OUT/suite.log" | tail -7;;
  esac
done
case ",$STEPS," in *,rowgroups,*)  # the attention of a whole video by row-group setting, then videos end to end
  echo "=== attention of a whole 768p and 384p video by row-group setting (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_video_attention.py --device cuda --settings "${ROW_GROUP_SETTINGS:-6144:1024,0:1024,0:512}" --json "$OUT/video_attention.json" 2>&1 | tee -a "$OUT/suite.log" | tail -8
  for n in ${ROW_GROUP_SWEEP:-0 6144}; do for res in 384p 768p; do
    echo "=== generate 5 s $res, compiled blocks, row groups from $n tokens (GPU $GPU)"
    CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_generate.py --device cuda --resolution $res --compile --decode-tile auto --row-group-min-tokens "$n" --json "$OUT/rowgroups_${res}_$n.json" 2>&1 | tee -a "$OUT/suite.log" | tail -1
  done; done;;
esac
case ",$STEPS," in *,gen768prof,*)
  echo "=== generate 5 s 768p, compiled blocks, eager calls: one video to compile, one under the profiler (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_generate.py --device cuda --resolution 768p --compile --decode-tile auto --no-cuda-graphs --videos 1 --profile --json "$OUT/gen768prof.json" 2>&1 | tee -a "$OUT/suite.log" | tail -22;;
esac
case ",$STEPS," in *,verify2,*)
  echo "=== verify, exact chunked encode on 2 GPUs (half the frames each)"; python benchmarks/bench_verify.py --device cuda --nproc 2 --json "$OUT/verify2.json" 2>&1 | tee -a "$OUT/suite.log" | grep -v "kept in float32" | tail -8;;
esac
case ",$STEPS," in *,traingraphs,*)
  echo "=== train, the whole trainer: compiled blocks as CUDA graphs, cuDNN attention (GPU $GPU)"; CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --device cuda --compile --cuda-graphs --attention cudnn --json "$OUT/train_graphs.json" 2>&1 | tee -a "$OUT/suite.log" | tail -14;;
esac
case ",$STEPS," in *,train,*)
  echo "=== train (no checkpointing)"; CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --device cuda --json "$OUT/train.json" 2>&1 | tee -a "$OUT/suite.log" | tail -14;;
esac
case ",$STEPS," in *,vae,*|*,vae384,*)
  echo "=== causal VAE alone at 384p, pfctl (layouts: ${LAYOUTS:-contiguous,channels_last}) vs the reference VAE"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_vae.py --device cuda --reference third_party/Pyramid-Flow --only decode384,encode384 --layouts "${LAYOUTS:-contiguous,channels_last}" --profile --json "$OUT/vae384.json" 2>&1 | tee -a "$OUT/suite.log" | grep -v "^{" | tail -40;;
esac
case ",$STEPS," in *,vae,*|*,vae768,*)
  echo "=== causal VAE alone at 768p, pfctl (layouts: ${LAYOUTS:-contiguous,channels_last}) vs the reference VAE"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_vae.py --device cuda --reference third_party/Pyramid-Flow --only decode768 --layouts "${LAYOUTS:-contiguous,channels_last}" --repeats 1 --profile --json "$OUT/vae768.json" 2>&1 | tee -a "$OUT/suite.log" | grep -v "^{" | tail -30;;
esac
case ",$STEPS," in *,encode,*)
  echo "=== encode-latents end to end (121-frame 640x384 mp4)"; CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_encode.py --device cuda --chunking framewise --num-workers 4 2>&1 | tee "$OUT/encode.txt" | tail -6;;
esac
case ",$STEPS," in *,lowmem,*)
  echo "=== generate --low-memory levels at 384p, real-size text encoders included (GPU $GPU; ~4 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_generate_parallel.py --levels none,offload,stream --resolution 384p --json "$OUT/lowmem.json" 2>&1 | tee -a "$OUT/suite.log" | tail -6;;
esac
case ",$STEPS," in *,lowmem768,*)
  echo "=== generate --low-memory levels at 768p, real-size text encoders included (GPU $GPU; ~8 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_generate_parallel.py --levels none,offload,stream --resolution 768p --json "$OUT/lowmem768.json" 2>&1 | tee -a "$OUT/suite.log" | tail -6;;
esac
case ",$STEPS," in *,fp8,*)
  echo "=== FP8 linear layers in generate, 384p (GPU $GPU; ~3 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_fp8.py --variants bf16,tensor,row --json "$OUT/fp8.json" 2>&1 | tee -a "$OUT/suite.log" | tail -6;;
esac
case ",$STEPS," in *,refgen1,*)
  echo "=== one video as a CLI run makes it: the reference's first video, pfctl's load, first and later video (GPU $GPU; ~3 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_reference.py generate --device cuda --repeats 2 --reference-repeats 1 --reference third_party/Pyramid-Flow --json "$OUT/refgen1.json" 2>&1 | tee -a "$OUT/suite.log" | tail -10;;
esac
case ",$STEPS," in *,recipe384,*)
  # one rank builds all 16 inputs; session 46 (H100, cold caches): step 1 107 s, steady at step 8 after 128 s
  echo "=== pfctl train, the 384p recipe as shipped, profiled, beside the reference's step (GPU $GPU; ~5 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --reference third_party/Pyramid-Flow --warmup 12 --steps 8 --progress --no-checkpoint --profile --compile-times --json "$OUT/recipe384.json" 2>&1 | tee -a "$OUT/suite.log" | grep -v -i warn | tail -70;;
esac
case ",$STEPS," in *,warmupprof,*)
  # session 25: step 1 93 s cold / 16 s warm, then steps 2-16 (first occurrences, recordings) 35-37 s either
  # way, of which cuDNN's planning ~5 s and the recordings ~9 s: where does the rest go?
  echo "=== the 384p recipe's warm-up, host time per phase and thread (GPU $GPU; ~5 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --warmup 17 --steps 3 --progress --no-checkpoint --host-profile 15 --host-phase-ends 8 --json "$OUT/warmupprof.json" 2>&1 | tee -a "$OUT/suite.log" | grep -E "^(bench step|warm-up|host samples|  (inclusive|leaf)|steady|time to)" | tail -150;;
esac
case ",$STEPS," in *,graphtests,*)
  # (no faulthandler stack dumps: on the GPU machine's Python 3.12 the dump itself crashed the process)
  echo "=== CUDA tests: graphs under accumulation vs eager, checkpointing + compile + FSDP2 vs eager (GPU $GPU; ~8 min)"
  CUDA_VISIBLE_DEVICES=$GPU timeout 560 python -m pytest -q -n 0 -p no:cacheprovider tests/integration/test_train_single.py tests/unit/test_dit_compile.py -k "cuda_graphs_train_like_the_eager_path_with_accumulation or compose_on_cuda" --durations=3 2>&1 | tee -a "$OUT/suite.log" | tail -12;;
esac
case ",$STEPS," in *,recipe768,*)
  # 8 timed steps: one whole cycle of the 8 temporal positions one GPU builds (their step times differ)
  echo "=== pfctl train, the 768p recipe on one GPU (checkpointing 0.75, compiled blocks), beside the reference's step (GPU $GPU; ~8 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-768p-8gpu --processes 1 --reference third_party/Pyramid-Flow --warmup 8 --steps 8 --progress --compile-times --json "$OUT/recipe768.json" 2>&1 | tee -a "$OUT/suite.log" | tail -40;;
esac
case ",$STEPS," in *,recipe768rowgroups,*)
  # session 26: the columns under 6,144 tokens take a third of the 768p step's attention work as one masked
  # call each (the memory-efficient kernel with a bias): does grouping them pay? (session 27: yes, -13%; the
  # recipe now groups every column, so the model's 6,144-token rule is the variant)
  echo "=== the 768p recipe on one GPU with every column in row groups, then with the 6,144-token rule (GPU $GPU; ~5 min)"
  for n in 0 6144; do
    set_n=(); [ $n = 6144 ] && set_n=(--set train.row_group_min_tokens=null)
    CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-768p-8gpu --processes 1 --warmup 8 --steps 8 --no-checkpoint "${set_n[@]}" --json "$OUT/recipe768_rowgroups_$n.json" 2>&1 | tee -a "$OUT/suite.log" | grep -E "^(steady|image tokens|MFU|peak|step times)"
  done;;
esac
case ",$STEPS," in *,recipe768rows,*)
  # session 28: the masked calls (groups of several small frames, on the memory-efficient kernel) took the
  # largest share of the 768p step's GPU time: one frame per group attends every call with no mask (flash)
  echo "=== the 768p recipe on one GPU, row groups closing at 512 rows (the model's), then one frame per group (GPU $GPU; ~5 min)"
  for n in 512 1; do
    CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-768p-8gpu --processes 1 --warmup 8 --steps 8 --no-checkpoint --set train.row_group_min_rows=$n --json "$OUT/recipe768_rows_$n.json" 2>&1 | tee -a "$OUT/suite.log" | grep -E "^(steady|image tokens|MFU|host busy|peak|step times|last loss|time to)"
  done;;
esac
case ",$STEPS," in *,recipe768kernels,*)
  # session 31: cuDNN's kernel for the row groups' masked calls (train.attention auto) against the memory-efficient one;
  # cuDNN plans each new shape in the first cycle, so the warm-up is one cycle (8 steps) and more
  echo "=== the 768p recipe on one GPU, masked calls on cuDNN (the default), then on the memory-efficient kernel (GPU $GPU; ~7 min cold)"
  for kernel in cudnn efficient; do
    CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-768p-8gpu --processes 1 --warmup 10 --steps 8 --no-checkpoint --set train.attention=$kernel --json "$OUT/recipe768_$kernel.json" 2>&1 | tee -a "$OUT/suite.log" | grep -E "^(steady|image tokens|MFU|host busy|peak|step times|last loss|time to)"
  done;;
esac
case ",$STEPS," in *,trainattention,*)
  # one layer's row-group attention of a 768p training cycle, forward and backward, host and device time
  echo "=== the 768p recipe's attention with gradients by row-group setting (GPU $GPU; ~2 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train_attention.py --device cuda --resolution 768p --settings "${TRAIN_ATTENTION_SETTINGS:-0:512,0:512:op,0:1,6144:512}" --json "$OUT/train_attention.json" 2>&1 | tee -a "$OUT/suite.log" | tail -6;;
esac
case ",$STEPS," in *,recipe768prof,*)
  # session 19: with skip_future_keys the 768p recipe ran 1.71 s a step (1.9x the reference); the profiled
  # cuDNN run was host-bound (GPU busy 36%): how busy is the GPU in the default step now?
  echo "=== the 768p recipe on one GPU, defaults, one step profiled (GPU $GPU; ~4 min)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-768p-8gpu --processes 1 --warmup 4 --steps 3 --no-checkpoint --profile 2>&1 | tee -a "$OUT/suite.log" | grep -v '^ ' | tail -40;;
esac
case ",$STEPS," in *,steptests,*)
  # session 46: a step's first micro-batch replaces the kept gradients; each case compiles the tiny DiT (~2 min)
  echo "=== CUDA tests: the step's graphs (eager and compiled blocks, merged and one by one) and the defaults (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU timeout 560 python -m pytest -q -n 0 -p no:cacheprovider \
    tests/unit/test_step_graphs.py::test_step_graphs_on_cuda_train_like_the_eager_path \
    "tests/integration/test_train_single.py::test_cuda_defaults_and_cuda_graphs_train_like_the_eager_path_with_accumulation[default]" \
    --durations=3 2>&1 | tee -a "$OUT/suite.log" | tail -12;;
esac
case ",$STEPS," in *,composetest,*)
  # session 21: 190 s a strategy, nearly all of it Dynamo's symbolic-shape reasoning (sympy) in the first trace
  echo "=== CUDA test: activation checkpointing + compiled blocks + FSDP2 against eager (GPU $GPU; ~7 min)"
  CUDA_VISIBLE_DEVICES=$GPU timeout 560 python -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_dit_compile.py -k compose_on_cuda --durations=3 2>&1 | tee -a "$OUT/suite.log" | tail -40;;
esac
case ",$STEPS," in *,rowgrouptests,*)
  # session 32: the row groups' training operator on CUDA, and the 768p recipe's speed settings in miniature
  # (compiled, checkpointed row groups on cuDNN) against the eager path
  echo "=== CUDA tests: the row groups' training operator and compiled row groups on cuDNN (GPU $GPU; ~3 min)"
  CUDA_VISIBLE_DEVICES=$GPU timeout 560 python -m pytest -q -n 0 -p no:cacheprovider tests/unit/test_row_group_operator.py tests/integration/test_train_single.py -k "operator or cudnn" --durations=3 2>&1 | tee -a "$OUT/suite.log" | tail -12;;
esac
case ",$STEPS," in *,gen2gpu,*)
  # issue 29: one video on 1 and 2 GPUs (CFG halves on two ranks), 768p then 384p (~6 min on 2 GPUs)
  for res in 768p 384p; do
    echo "=== generate one 5 s $res video on 1 and 2 GPUs (and 1 without CUDA graphs)"
    python benchmarks/bench_generate_parallel.py --processes 1,2 --resolution $res --json "$OUT/gen2gpu_$res.json" 2>&1 | tee -a "$OUT/suite.log" | tail -5
  done;;
esac
case ",$STEPS," in *,recipe384warm,*)
  # the 384p recipe twice on one machine: the second run finds Inductor's, AOTAutograd's and Triton's caches
  # (under /tmp) warm from the first, as a user's next run or a resumed one does (~7 min)
  for run in cold warm; do
    echo "=== the 384p recipe on one GPU, $run compile caches (GPU $GPU)"
    CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --warmup 16 --steps 4 --progress --no-checkpoint --compile-times --json "$OUT/recipe384_$run.json" 2>&1 | tee -a "$OUT/suite.log" | grep -E "^(bench step|warm-up|steady|time to|first|image tokens/s|MFU|peak|Python GC|compile caches|AOTAutograd cache|_compile.compile_inner|bytecode_tracing|aot_trace|create_aot|Scheduler.codegen|CUDAGraphNode)" | tail -45
  done;;
esac
case ",$STEPS," in *,recipe384cache,*)
  # the 384p recipe twice with one output directory, each run on compile caches of its own (empty at its
  # start): the second has only the first run's OUTPUT/compile-cache.bin, as a resumed run on another machine
  # (~5 min)
  run_dir=$(mktemp -d)
  for run in cold file; do
    echo "=== the 384p recipe on one GPU, $run (GPU $GPU)"
    TORCHINDUCTOR_CACHE_DIR="$run_dir/inductor-$run" TRITON_CACHE_DIR="$run_dir/triton-$run" CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --warmup 16 --steps 8 --progress --no-checkpoint --compile-times --set train.output_dir="$run_dir/out" --json "$OUT/recipe384_cache_$run.json" 2>&1 | tee -a "$OUT/suite.log" | grep -E "^(compile cache|warm-up|steady|time to|image tokens/s|MFU|compile caches)" | tail -12
  done
  rm -rf "$run_dir";;
esac
case ",$STEPS," in *,recipe384graphs,*)
  # the default since session 38 (no CUDA graphs), then with them: in session 36, with the right gradients, the
  # 384p recipe's timed steps ran 0.3 s or 0.8-2.2 s by step with graphs; each step's graph-tree calls by outcome
  # (replayed, recorded, warm-up runs, without a graph, failed checks and what they found, by graph); each run
  # with the host's hot spots per phase and thread (in $OUT/suite.log) (~8 min)
  for graphs in auto true; do
    echo "=== the 384p recipe on one GPU, train.cuda_graphs=$graphs (GPU $GPU)"
    CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --warmup 16 --steps 16 --progress --no-checkpoint --set train.cuda_graphs=$graphs --host-profile 30 --json "$OUT/recipe384_graphs_$graphs.json" 2>&1 | tee -a "$OUT/suite.log" | grep -E "^(bench step (1|9|1[6-9]|2[0-9]|3[0-2]):|steady|time to steady|MFU|host busy|peak|CUDA graphs)" | cut -c1-500
  done;;
esac
case ",$STEPS," in *,recipe384cpp,*)
  # session 37's candidate for the host-bound steps without CUDA graphs: Inductor's C++ wrapper launches each
  # compiled graph's kernels without Python (~5 min)
  echo "=== the 384p recipe on one GPU, defaults (no CUDA graphs), Inductor's cpp_wrapper (GPU $GPU)"
  CUDA_VISIBLE_DEVICES=$GPU python benchmarks/bench_train.py --recipe pyramid-flux-384p-8gpu --processes 1 --warmup 16 --steps 16 --progress --no-checkpoint --inductor cpp_wrapper=True --json "$OUT/recipe384_cpp.json" 2>&1 | tee -a "$OUT/suite.log" | grep -E "^(bench step (1|9|1[6-9]|2[0-9]|3[0-2]):|steady|MFU|host busy|peak|inductor options)" | cut -c1-400;;
esac
# last, a short table of every recipe run this call wrote (bench_train.py --json)
ls "$OUT"/recipe*.json >/dev/null 2>&1 && python - "$OUT" <<'PY'
import json, pathlib, sys
starts = ("steady step time", "time to steady", "MFU (6", "host busy", "peak memory (timed", "reference step")
print("=== summary: " + " | ".join(starts))
for path in sorted(pathlib.Path(sys.argv[1]).glob("recipe*.json")):
    report = json.loads(path.read_text())
    found = [next((str(v) for k, v in report.items() if k.startswith(start)), "-")[:40] for start in starts]
    print(path.stem + ": " + " | ".join(found))
PY
