"""The ground every layer stands on: the mesh, errors, the few private torch APIs, process-group
set-up, the step contract and parameter placement records. Imports nothing else of trainmesh but comm.
"""
