"""Generating videos from a model: the sampler (sampler.py) and what it writes (outputs.py)."""
from dit_train.sampling.outputs import frame_grid, scored_view, to_pixels, write_samples
from dit_train.sampling.sampler import (SampleRequest, VideoSampler, dataset_requests, pipeline_shift, predict_velocity,
                                       run_sampling, sampling_boundary, source_requests)

__all__ = ["SampleRequest", "VideoSampler", "dataset_requests", "frame_grid", "pipeline_shift", "predict_velocity", "run_sampling", "sampling_boundary", "scored_view", "source_requests", "to_pixels",
           "write_samples"]
