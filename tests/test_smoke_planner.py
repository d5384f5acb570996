from fsdp_pass.planner import TensorSpec, plan


def test_toy_example_from_the_paper_notes():
    specs = [TensorSpec("t1", 12, 4), TensorSpec("t2", 10, 2), TensorSpec("t3", 6, 3), TensorSpec("t4", 3, 1)]
    layout = plan(specs, 3, align=1, orders=["given"])
    layout.validate()
    assert layout.shard_size == 12
    assert layout.offsets == {"t1": 0, "t2": 12, "t3": 24, "t4": 30}
