"""Fault tolerance (``--fault-tolerant``): the per-step quorum of DP replicas, its coordinator,
the replicas' client side and live-state transfer. Imports core, comm and observe only.
"""
