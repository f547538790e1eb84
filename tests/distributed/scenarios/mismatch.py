"""Parameter shapes that differ across ranks: a clear ValueError at
construction, on every rank, naming the parameter and both shapes."""

from mpi_common import comm, make_model, passed, report

from pyengine.distributed import DataParallel

last = comm.Get_size() - 1
sizes = [5, 25 if comm.Get_rank() == last else 24, 3]
model = make_model(seed=0, sizes=sizes)
try:
    DataParallel(model, timeout=10)
except ValueError as error:
    message = str(error)
    expected = (f"parameter 0 differs across ranks: rank {last} has 'modules.0.weight' with shape (25, 5)",
                "rank 0 has 'modules.0.weight' with shape (24, 5)")
    assert all(part in message for part in expected), message
    report(f"CLEAR-ERROR rank {comm.Get_rank()}: ValueError: {message}")
else:
    raise AssertionError("no error for parameters that differ across ranks")
passed()
