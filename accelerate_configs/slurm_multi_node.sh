#!/bin/bash
# SLURM: 4 nodes x 8 GPUs, one launcher per node; accelerate starts the 8 workers on each node.
#SBATCH --job-name=birder-resnet50
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=29500
# fail in seconds, not after the 30-minute process-group timeout: address, port, interfaces, layout (one per node)
srun bash -c 'birder-hf preflight --config_file accelerate_configs/multi_node_4x8.yaml \
    --machine_rank $SLURM_NODEID --main_process_ip $MASTER_ADDR --main_process_port $MASTER_PORT --params 25.6e6'
srun bash -c 'accelerate launch --config_file accelerate_configs/multi_node_4x8.yaml \
    --machine_rank $SLURM_NODEID --main_process_ip $MASTER_ADDR --main_process_port $MASTER_PORT \
    recipes/resnet50.py --data_dir /data/imagenet --batch_size 256 --epochs 100 --lr 0.004 \
    --weight_decay 0.1 --beta 0.95 --warmup_epochs 10 --hierarchy --output_dir outputs/resnet50_4x8'
