"""Process plumbing, with no model in it: where files live (data_dirs), writes a crash cannot tear
(durable), glibc's heap kept for reuse and read (host_memory), the memory each compiled program holds
(program_memory). Imports: jaxsmol.errors only."""
