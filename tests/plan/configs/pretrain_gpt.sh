#!/bin/bash
# GPT pretraining with Megatron-LM on 2 nodes of 8 GPUs, a batch ramp at the start.

GPUS_PER_NODE=8
NNODES=2
LR=1.5e-4

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --master_addr localhost --master_port 6000"

torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 \
    --num-layers 24 \
    --hidden-size 1024 \
    --num-attention-heads 16 \
    --seq-length 2048 \
    --max-position-embeddings 2048 \
    --micro-batch-size 4 \
    --global-batch-size 128 \
    --rampup-batch-size 32 32 1000000 \
    --lr $LR \
    --min-lr 1.0e-5 \
    --lr-decay-style cosine \
    --lr-warmup-iters 2000 \
    --train-iters 100000 \
    --weight-decay 0.1 \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --clip-grad 1.0 \
    --bf16
