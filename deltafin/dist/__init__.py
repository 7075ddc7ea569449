"""A model split across processes and hosts (torchrun, torch.distributed): see docs/distributed.md.

launch.py: the launch read from torchrun's environment, and joining the group; transport.py: messages
and rows between ranks, and naming the rank at fault; placement.py: which layers each rank holds, and
the check that every rank has the same model; pipeline.py: rank 0's engine, whose passes flow through
every rank; worker.py: the loop of every other rank.
"""
