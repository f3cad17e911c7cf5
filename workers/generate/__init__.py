"""The generate role for images and video: diffusers pipelines behind step() engines, with sequence
parallelism for their transformers."""
