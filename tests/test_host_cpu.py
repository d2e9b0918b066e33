"""host_cpu: what benchmarks record of the CPU and what engine choices read from it."""

from recguide_jax.runtime import host_cpu


def test_last_level_cache_is_a_size_or_unknown():
  size = host_cpu.last_level_cache_bytes()
  assert size is None or (isinstance(size, int) and size > 0)


def test_cpu_model_names_the_cpu(tmp_path):
  name = host_cpu.cpu_model()
  assert isinstance(name, str) and name.strip() == name and name
  fake = tmp_path / "cpuinfo"
  fake.write_text("processor\t: 0\nvendor_id\t: Example\nmodel name\t:  Example CPU 9000  \n")
  assert host_cpu.cpu_model(str(fake)) == "Example CPU 9000"
  assert host_cpu.cpu_model(str(tmp_path / "missing"))  # what `platform` says, never empty
