#!/bin/bash
#SBATCH --job-name=train-replicas
#SBATCH --nodes=3                     # one replica group per node
#SBATCH --ntasks-per-node=1           # one torchrun per node
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --no-kill                     # a failed node does not end the allocation
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#
# Replica groups (docs/replica-groups.md) in one SLURM job: one group per node, each an srun step of its own, and the
# lighthouse beside the first group, kept up by lighthouse_loop.sh: killed or crashed, it is back at the same address
# a second later, and the groups go on at their next quorum. The batch script runs on the first node: losing that
# node ends the job (requeue it; the groups resume from their newest checkpoint).
#
# Environment (defaults for a real job; the test suite sets them to run this script on one machine):
#   LIGHTHOUSE_LOOP  lighthouse_loop.sh (default: the one beside this script in the submit directory)
#   LIGHTHOUSE_BIND  the lighthouse's address (default 0.0.0.0:29510)
#   TRAIN_COMMAND    what each group's srun step runs (default: torchrun of train.py on 8 GPUs)
set -u
loop=${LIGHTHOUSE_LOOP:-$SLURM_SUBMIT_DIR/examples/lighthouse/lighthouse_loop.sh}
env_file="lighthouse-$SLURM_JOB_ID.env"
rm -f "$env_file"

"$loop" "$env_file" --min-replicas 2 --bind "${LIGHTHOUSE_BIND:-0.0.0.0:29510}" &
lighthouse=$!
until [ -s "$env_file" ]; do
    kill -0 "$lighthouse" 2>/dev/null || exit 1        # it could not start (its error is in the log)
    sleep 0.5
done
export $(cat "$env_file") NUM_REPLICA_GROUPS="$SLURM_NNODES"

read -r -a train <<< "${TRAIN_COMMAND:-torchrun --standalone --nproc-per-node=8 --max-restarts=100 train.py}"
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
groups=()
for i in "${!nodes[@]}"; do
    REPLICA_GROUP_ID=$i srun --nodes=1 --ntasks=1 --nodelist="${nodes[$i]}" --cpus-per-task="$SLURM_CPUS_ON_NODE" \
        --kill-on-bad-exit=0 "${train[@]}" &
    groups+=($!)
done
status=0
for group in "${groups[@]}"; do
    wait "$group" || status=1
done
kill "$lighthouse"                    # SIGTERM: the loop stops the lighthouse and exits with 0
wait "$lighthouse"
exit "$status"
