"""Kubernetes: a job as one JobSet whose child Jobs are its replica groups (``unbroken k8s render``).

Pure rendering from typed settings (``k8s_settings.py``, ``render.py``), the command lines shared
with the cluster box (``commands.py``), the JobSet and Job controllers' failure rules simulated
(``failure_sim.py``), and offline validation against the vendored schemas (``validate.py``).
"""
