"""Running a job: the local launcher (torch's elastic agent), the training loop, elastic resize,
optimizers and LR schedule, evaluation. Imports the engine and everything below it; never cli/.
"""
