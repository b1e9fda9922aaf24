"""llama.cpp beside mlxr on the same random real-shape models (issues #28, #29, #32).

shapes: the HF config and tokenizer of each named shape (from make_checkpoint's tables, so
both sides read the same shape); hf_checkpoint: the random bf16 HF files llama.cpp's converter
reads, written tensor by tensor; build: llama.cpp's tree from the llama-cpp-python sdist, its
cmake build, convert and quantize; compare: the alternating runs and the table; cli: the
command both `benchmarks/{cpu,gpu}/llamacpp_side_by_side.py` run.
"""
