"""Benchmarks of training through faults: recovery and overhead (``recovery``), checkpoints,
torchtitan's trainer against torchft (``titan_trainer``), silent data corruption (``sdc``), the
exchange's lockstep, and what scraping ``/metrics`` costs."""
