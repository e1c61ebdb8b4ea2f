/*
 * commands.h -- the commands of `mha`, one file each (cmd_*.c).  Each
 * takes its own argv (argv[0] is the command's name) and returns the exit
 * status: 0, or 1 after printing why.  mha.c lists them in its table.
 */
#ifndef MHA_TOOL_COMMANDS_H
#define MHA_TOOL_COMMANDS_H

int cmd_example(int argc, char **argv);
int cmd_forward(int argc, char **argv);
int cmd_backward(int argc, char **argv);
int cmd_decode(int argc, char **argv);
int cmd_init(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_viz(int argc, char **argv);
int cmd_prune(int argc, char **argv);
/* `forward --ring` and `bench --ring` (cmd_ring.c): under mpirun, on
 * libmha_mpi; without MPI they say so and fail. */
int cmd_forward_ring(int argc, char **argv);
int cmd_backward_ring(int argc, char **argv);
int cmd_bench_ring(int argc, char **argv);

#endif
