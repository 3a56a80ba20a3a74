"""A cluster in a box: hosts as Linux network namespaces on one machine, with real network faults.

:mod:`unbroken.cluster.box` builds and tears down the namespaces, links and bridge and injects
the faults (node loss, partitions, a ``tbf``-shaped slow link); :mod:`unbroken.cluster.job`
runs a coordinator and one ``unbroken agent`` per host in it; :mod:`unbroken.cluster.scenarios`
holds what must hold under each fault (``unbroken bench cluster``); :mod:`unbroken.cluster.slurm`
runs a real Slurm in the box for the README's Slurm example (``--slurm``). Root is needed.
"""
