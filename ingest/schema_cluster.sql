CREATE TABLE IF NOT EXISTS gpu_samples_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    pool LowCardinality(String),
    gpu UInt16,
    mig_gi Int16 DEFAULT -1,
    mig_ci Int16 DEFAULT -1,
    mig_profile LowCardinality(String),
    gpu_fraction Float32 DEFAULT 1,
    uuid String,
    model LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    interval_s Float32,
    healthy UInt8,
    activity Nullable(Float32),
    alloc_share Float32,
    alloc_schedulers Array(LowCardinality(String)),
    alloc_ids Array(String),
    alloc_names Array(String),
    alloc_users Array(LowCardinality(String)),
    alloc_accounts Array(LowCardinality(String)),
    alloc_queues Array(LowCardinality(String)),
    alloc_shares Array(Float32),
    alloc_act_shares Array(Float32) DEFAULT alloc_shares,
    alloc_fb_shares Array(Float32) DEFAULT alloc_shares,
    alloc_share_sources Array(LowCardinality(String)) DEFAULT arrayMap(x -> '', alloc_ids),
    DCGM_FI_DEV_GPU_UTIL Nullable(Float64),
    DCGM_FI_DEV_MEM_COPY_UTIL Nullable(Float64),
    DCGM_FI_DEV_ENC_UTIL Nullable(Float64),
    DCGM_FI_DEV_DEC_UTIL Nullable(Float64),
    DCGM_FI_DEV_FB_USED Nullable(Float64),
    DCGM_FI_DEV_FB_FREE Nullable(Float64),
    DCGM_FI_DEV_FB_TOTAL Nullable(Float64),
    DCGM_FI_DEV_FB_RESERVED Nullable(Float64),
    DCGM_FI_DEV_POWER_USAGE Nullable(Float64),
    DCGM_FI_DEV_POWER_MGMT_LIMIT Nullable(Float64),
    DCGM_FI_DEV_ENFORCED_POWER_LIMIT Nullable(Float64),
    DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Nullable(Float64),
    DCGM_FI_DEV_GPU_TEMP Nullable(Float64),
    DCGM_FI_DEV_MEMORY_TEMP Nullable(Float64),
    DCGM_FI_DEV_SM_CLOCK Nullable(Float64),
    DCGM_FI_DEV_MEM_CLOCK Nullable(Float64),
    DCGM_FI_DEV_CLOCKS_EVENT_REASONS Nullable(Float64),
    DCGM_FI_DEV_PCIE_REPLAY_COUNTER Nullable(Float64),
    DCGM_FI_DEV_XID_ERRORS Nullable(Float64),
    DCGM_FI_DEV_ECC_SBE_VOL_TOTAL Nullable(Float64),
    DCGM_FI_DEV_ECC_DBE_VOL_TOTAL Nullable(Float64),
    DCGM_FI_DEV_ECC_SBE_AGG_TOTAL Nullable(Float64),
    DCGM_FI_DEV_ECC_DBE_AGG_TOTAL Nullable(Float64),
    DCGM_FI_DEV_ROW_REMAP_PENDING Nullable(Float64),
    DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS Nullable(Float64),
    DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS Nullable(Float64),
    DCGM_FI_DEV_ROW_REMAP_FAILURE Nullable(Float64),
    DCGM_FI_PROF_GR_ENGINE_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_SM_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_SM_OCCUPANCY Nullable(Float64),
    DCGM_FI_PROF_PIPE_TENSOR_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_PIPE_FP64_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_PIPE_FP32_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_PIPE_FP16_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_DRAM_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_PCIE_TX_BYTES Nullable(Float64),
    DCGM_FI_PROF_PCIE_RX_BYTES Nullable(Float64),
    DCGM_FI_PROF_NVLINK_TX_BYTES Nullable(Float64),
    DCGM_FI_PROF_NVLINK_RX_BYTES Nullable(Float64),
    DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL Nullable(Float64),
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, node, gpu, mig_gi, mig_ci, ts)
TTL toDate(ts) + INTERVAL 400 DAY
SETTINGS min_bytes_for_wide_part = 33554432;

CREATE TABLE IF NOT EXISTS gpu_samples ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    pool LowCardinality(String),
    gpu UInt16,
    mig_gi Int16 DEFAULT -1,
    mig_ci Int16 DEFAULT -1,
    mig_profile LowCardinality(String),
    gpu_fraction Float32 DEFAULT 1,
    uuid String,
    model LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    interval_s Float32,
    healthy UInt8,
    activity Nullable(Float32),
    alloc_share Float32,
    alloc_schedulers Array(LowCardinality(String)),
    alloc_ids Array(String),
    alloc_names Array(String),
    alloc_users Array(LowCardinality(String)),
    alloc_accounts Array(LowCardinality(String)),
    alloc_queues Array(LowCardinality(String)),
    alloc_shares Array(Float32),
    alloc_act_shares Array(Float32) DEFAULT alloc_shares,
    alloc_fb_shares Array(Float32) DEFAULT alloc_shares,
    alloc_share_sources Array(LowCardinality(String)) DEFAULT arrayMap(x -> '', alloc_ids),
    DCGM_FI_DEV_GPU_UTIL Nullable(Float64),
    DCGM_FI_DEV_MEM_COPY_UTIL Nullable(Float64),
    DCGM_FI_DEV_ENC_UTIL Nullable(Float64),
    DCGM_FI_DEV_DEC_UTIL Nullable(Float64),
    DCGM_FI_DEV_FB_USED Nullable(Float64),
    DCGM_FI_DEV_FB_FREE Nullable(Float64),
    DCGM_FI_DEV_FB_TOTAL Nullable(Float64),
    DCGM_FI_DEV_FB_RESERVED Nullable(Float64),
    DCGM_FI_DEV_POWER_USAGE Nullable(Float64),
    DCGM_FI_DEV_POWER_MGMT_LIMIT Nullable(Float64),
    DCGM_FI_DEV_ENFORCED_POWER_LIMIT Nullable(Float64),
    DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Nullable(Float64),
    DCGM_FI_DEV_GPU_TEMP Nullable(Float64),
    DCGM_FI_DEV_MEMORY_TEMP Nullable(Float64),
    DCGM_FI_DEV_SM_CLOCK Nullable(Float64),
    DCGM_FI_DEV_MEM_CLOCK Nullable(Float64),
    DCGM_FI_DEV_CLOCKS_EVENT_REASONS Nullable(Float64),
    DCGM_FI_DEV_PCIE_REPLAY_COUNTER Nullable(Float64),
    DCGM_FI_DEV_XID_ERRORS Nullable(Float64),
    DCGM_FI_DEV_ECC_SBE_VOL_TOTAL Nullable(Float64),
    DCGM_FI_DEV_ECC_DBE_VOL_TOTAL Nullable(Float64),
    DCGM_FI_DEV_ECC_SBE_AGG_TOTAL Nullable(Float64),
    DCGM_FI_DEV_ECC_DBE_AGG_TOTAL Nullable(Float64),
    DCGM_FI_DEV_ROW_REMAP_PENDING Nullable(Float64),
    DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS Nullable(Float64),
    DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS Nullable(Float64),
    DCGM_FI_DEV_ROW_REMAP_FAILURE Nullable(Float64),
    DCGM_FI_PROF_GR_ENGINE_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_SM_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_SM_OCCUPANCY Nullable(Float64),
    DCGM_FI_PROF_PIPE_TENSOR_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_PIPE_FP64_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_PIPE_FP32_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_PIPE_FP16_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_DRAM_ACTIVE Nullable(Float64),
    DCGM_FI_PROF_PCIE_TX_BYTES Nullable(Float64),
    DCGM_FI_PROF_PCIE_RX_BYTES Nullable(Float64),
    DCGM_FI_PROF_NVLINK_TX_BYTES Nullable(Float64),
    DCGM_FI_PROF_NVLINK_RX_BYTES Nullable(Float64),
    DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL Nullable(Float64),
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'gpu_samples_local', cityHash64(cluster, node));

CREATE TABLE IF NOT EXISTS node_heartbeats_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    pool LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    interval_s Float32,
    schedulable UInt8,
    state LowCardinality(String),
    reason String,
    gpus UInt16,
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, node, ts)
TTL toDate(ts) + INTERVAL 400 DAY;

CREATE TABLE IF NOT EXISTS node_heartbeats ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    pool LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    interval_s Float32,
    schedulable UInt8,
    state LowCardinality(String),
    reason String,
    gpus UInt16,
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'node_heartbeats_local', cityHash64(cluster, node));

CREATE TABLE IF NOT EXISTS sched_events_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    scheduler LowCardinality(String),
    event LowCardinality(String),
    request_id String,
    ts DateTime64(3, 'UTC'),
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    pool LowCardinality(String),
    gpus_per_node Float32,
    nodes UInt32,
    reason LowCardinality(String),
    assigned_nodes Array(String),
    cause LowCardinality(String) DEFAULT '',
    cluster_queue LowCardinality(String) DEFAULT '',
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, scheduler, request_id, event, ts)
TTL toDate(ts) + INTERVAL 400 DAY;

CREATE TABLE IF NOT EXISTS sched_events ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    scheduler LowCardinality(String),
    event LowCardinality(String),
    request_id String,
    ts DateTime64(3, 'UTC'),
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    pool LowCardinality(String),
    gpus_per_node Float32,
    nodes UInt32,
    reason LowCardinality(String),
    assigned_nodes Array(String),
    cause LowCardinality(String) DEFAULT '',
    cluster_queue LowCardinality(String) DEFAULT '',
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'sched_events_local', cityHash64(cluster, scheduler, request_id));

CREATE TABLE IF NOT EXISTS latency_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    service LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    interval_s Float32,
    bounds_ms Array(Float64),
    counts Array(UInt64),
    total UInt64,
    sum_ms Float64,
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, service, source, ts)
TTL toDate(ts) + INTERVAL 400 DAY;

CREATE TABLE IF NOT EXISTS latency ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    service LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    interval_s Float32,
    bounds_ms Array(Float64),
    counts Array(UInt64),
    total UInt64,
    sum_ms Float64,
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'latency_local', cityHash64(cluster, service));

CREATE TABLE IF NOT EXISTS health_events_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    gpu UInt16,
    uuid String,
    ts DateTime64(3, 'UTC'),
    event LowCardinality(String),
    code UInt32,
    fatal UInt8,
    message String,
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3),
    msg_key UInt64 DEFAULT cityHash64(source, boot_id, seq)
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', ingested_at)
PARTITION BY toDate(ts)
ORDER BY (cluster, node, gpu, ts, event, msg_key)
TTL toDate(ts) + INTERVAL 400 DAY;

CREATE TABLE IF NOT EXISTS health_events ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    gpu UInt16,
    uuid String,
    ts DateTime64(3, 'UTC'),
    event LowCardinality(String),
    code UInt32,
    fatal UInt8,
    message String,
    source LowCardinality(String),
    boot_id String,
    seq UInt64,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3),
    msg_key UInt64 DEFAULT cityHash64(source, boot_id, seq)
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'health_events_local', cityHash64(cluster, node));

CREATE TABLE IF NOT EXISTS dead_letters_local ON CLUSTER 'gpuslo'
(
    received_at DateTime64(3, 'UTC'),
    origin String,
    topic LowCardinality(String),
    partition Int32,
    offset Int64,
    reason String,
    raw String,
    raw_hash UInt64
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(received_at)
ORDER BY (origin, raw_hash)
TTL toDateTime(received_at) + INTERVAL 90 DAY;

CREATE TABLE IF NOT EXISTS dead_letters ON CLUSTER 'gpuslo'
(
    received_at DateTime64(3, 'UTC'),
    origin String,
    topic LowCardinality(String),
    partition Int32,
    offset Int64,
    reason String,
    raw String,
    raw_hash UInt64
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'dead_letters_local', cityHash64(origin, raw_hash));

CREATE TABLE IF NOT EXISTS rollup_dirty_local ON CLUSTER 'gpuslo'
(
    kind LowCardinality(String),
    cluster LowCardinality(String),
    key LowCardinality(String),
    minute DateTime('UTC'),
    at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toDate(at)
ORDER BY at
TTL toDateTime(at) + INTERVAL 14 DAY;

CREATE TABLE IF NOT EXISTS rollup_dirty ON CLUSTER 'gpuslo'
(
    kind LowCardinality(String),
    cluster LowCardinality(String),
    key LowCardinality(String),
    minute DateTime('UTC'),
    at DateTime64(3, 'UTC')
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'rollup_dirty_local', cityHash64(cluster, key));

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_samples_dirty_mv ON CLUSTER 'gpuslo' TO rollup_dirty_local AS
SELECT DISTINCT 'gpu' AS kind, cluster, node AS key,
    toDateTime(arrayJoin(range(toUInt32(intDiv(toInt64(toFloat64(ts)), 60) * 60),
                               toUInt32(ceil(toFloat64(ts) + 2 * interval_s)), 60)), 'UTC') AS minute,
    now64(3) AS at
FROM gpu_samples_local;

CREATE MATERIALIZED VIEW IF NOT EXISTS node_heartbeats_dirty_mv ON CLUSTER 'gpuslo' TO rollup_dirty_local AS
SELECT DISTINCT 'heartbeat' AS kind, cluster, node AS key, toStartOfMinute(ts) AS minute, now64(3) AS at
FROM node_heartbeats_local;

CREATE MATERIALIZED VIEW IF NOT EXISTS latency_dirty_mv ON CLUSTER 'gpuslo' TO rollup_dirty_local AS
SELECT DISTINCT 'latency' AS kind, cluster, service AS key,
    toDateTime(toInt64(ceil(toFloat64(ts) / 60) * 60), 'UTC') AS minute, now64(3) AS at
FROM latency_local;

CREATE TABLE IF NOT EXISTS gpu_rollup_1m_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    pool LowCardinality(String),
    node LowCardinality(String),
    minute DateTime('UTC'),
    samples UInt32,
    capacity_s Float64,
    allocated_s Float64,
    active_s Float64,
    idle_allocated_s Array(Float64),
    idle_unallocated_s Array(Float64),
    snap_ts Array(DateTime64(3, 'UTC')),
    snap_interval_s Array(Float32),
    snap_free Array(Float64),
    snap_whole_free Array(UInt32),
    snap_frac_free Array(Float64),
    version UInt64
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', version)
PARTITION BY toYYYYMM(minute)
ORDER BY (cluster, node, minute)
TTL toDate(minute) + INTERVAL 800 DAY
COMMENT 'per node per minute, idle_*_s[i] for the i-th of 7 thresholds [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5], snap_* per sample time';

CREATE TABLE IF NOT EXISTS gpu_rollup_1m ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    pool LowCardinality(String),
    node LowCardinality(String),
    minute DateTime('UTC'),
    samples UInt32,
    capacity_s Float64,
    allocated_s Float64,
    active_s Float64,
    idle_allocated_s Array(Float64),
    idle_unallocated_s Array(Float64),
    snap_ts Array(DateTime64(3, 'UTC')),
    snap_interval_s Array(Float32),
    snap_free Array(Float64),
    snap_whole_free Array(UInt32),
    snap_frac_free Array(Float64),
    version UInt64
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'gpu_rollup_1m_local', cityHash64(cluster, node));

CREATE TABLE IF NOT EXISTS owner_rollup_1m_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    minute DateTime('UTC'),
    id String,
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    allocated_s Float64,
    idle_s Array(Float64),
    version UInt64
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', version)
PARTITION BY toYYYYMM(minute)
ORDER BY (cluster, node, minute, id)
TTL toDate(minute) + INTERVAL 800 DAY;

CREATE TABLE IF NOT EXISTS owner_rollup_1m ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    minute DateTime('UTC'),
    id String,
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    allocated_s Float64,
    idle_s Array(Float64),
    version UInt64
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'owner_rollup_1m_local', cityHash64(cluster, node));

CREATE TABLE IF NOT EXISTS latency_rollup_1m_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    service LowCardinality(String),
    minute_end DateTime('UTC'),
    bounds_hash UInt64,
    bounds_ms Array(Float64),
    counts Array(UInt64),
    total UInt64,
    sum_ms Float64,
    version UInt64
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', version)
PARTITION BY toYYYYMM(minute_end)
ORDER BY (cluster, service, minute_end, bounds_hash)
TTL toDate(minute_end) + INTERVAL 800 DAY;

CREATE TABLE IF NOT EXISTS latency_rollup_1m ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    service LowCardinality(String),
    minute_end DateTime('UTC'),
    bounds_hash UInt64,
    bounds_ms Array(Float64),
    counts Array(UInt64),
    total UInt64,
    sum_ms Float64,
    version UInt64
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'latency_rollup_1m_local', cityHash64(cluster, service));

CREATE TABLE IF NOT EXISTS gpu_rollup_1h_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    pool LowCardinality(String),
    node LowCardinality(String),
    hour DateTime('UTC'),
    samples UInt32,
    capacity_s Float64,
    allocated_s Float64,
    active_s Float64,
    idle_allocated_s Array(Float64),
    idle_unallocated_s Array(Float64),
    version UInt64,
    dropped UInt8
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', version, dropped)
PARTITION BY toYYYYMM(hour)
ORDER BY (cluster, node, hour, pool)
TTL toDate(hour) + INTERVAL 800 DAY
COMMENT 'per node, hour and pool: sums of gpu_rollup_1m, idle_*_s[i] for the i-th of 7 thresholds [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5]';

CREATE TABLE IF NOT EXISTS gpu_rollup_1h ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    pool LowCardinality(String),
    node LowCardinality(String),
    hour DateTime('UTC'),
    samples UInt32,
    capacity_s Float64,
    allocated_s Float64,
    active_s Float64,
    idle_allocated_s Array(Float64),
    idle_unallocated_s Array(Float64),
    version UInt64,
    dropped UInt8
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'gpu_rollup_1h_local', cityHash64(cluster, node));

CREATE TABLE IF NOT EXISTS owner_rollup_1h_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    hour DateTime('UTC'),
    id String,
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    allocated_s Float64,
    idle_s Array(Float64),
    version UInt64,
    dropped UInt8
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', version, dropped)
PARTITION BY toYYYYMM(hour)
ORDER BY (cluster, node, hour, id, name, user, account, queue)
TTL toDate(hour) + INTERVAL 800 DAY;

CREATE TABLE IF NOT EXISTS owner_rollup_1h ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    node LowCardinality(String),
    hour DateTime('UTC'),
    id String,
    name String,
    user LowCardinality(String),
    account LowCardinality(String),
    queue LowCardinality(String),
    allocated_s Float64,
    idle_s Array(Float64),
    version UInt64,
    dropped UInt8
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'owner_rollup_1h_local', cityHash64(cluster, node));

CREATE TABLE IF NOT EXISTS capacity_steps_1m_local ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    minute DateTime('UTC'),
    every Array(UInt8),
    pool_key Array(String),
    step_at Array(Array(Float64)),
    step_free Array(Array(Decimal128(20))),
    step_shapes Array(Array(Array(Float64))),
    step_nodes Array(Array(Array(Int64))),
    version UInt64
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', version)
PARTITION BY toYYYYMM(minute)
ORDER BY (cluster, minute)
TTL toDate(minute) + INTERVAL 800 DAY
COMMENT 'per cluster and minute: the starvation snapshot streams (every, pool_key) as step functions';

CREATE TABLE IF NOT EXISTS capacity_steps_1m ON CLUSTER 'gpuslo'
(
    cluster LowCardinality(String),
    minute DateTime('UTC'),
    every Array(UInt8),
    pool_key Array(String),
    step_at Array(Array(Float64)),
    step_free Array(Array(Decimal128(20))),
    step_shapes Array(Array(Array(Float64))),
    step_nodes Array(Array(Array(Int64))),
    version UInt64
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'capacity_steps_1m_local', cityHash64(cluster));

CREATE TABLE IF NOT EXISTS rollup_state_local ON CLUSTER 'gpuslo'
(
    name LowCardinality(String),
    watermark DateTime64(3, 'UTC'),
    updated DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', updated)
ORDER BY name;

CREATE TABLE IF NOT EXISTS rollup_state ON CLUSTER 'gpuslo'
(
    name LowCardinality(String),
    watermark DateTime64(3, 'UTC'),
    updated DateTime64(3, 'UTC')
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'rollup_state_local', cityHash64(name));

CREATE TABLE IF NOT EXISTS rule_results_local ON CLUSTER 'gpuslo'
(
    evaluated_at DateTime('UTC'),
    window_s UInt32,
    rule LowCardinality(String),
    cluster LowCardinality(String),
    pool LowCardinality(String),
    label String,
    value Nullable(Float64)
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(evaluated_at)
ORDER BY (rule, window_s, cluster, pool, label, evaluated_at)
TTL toDate(evaluated_at) + INTERVAL 800 DAY;

CREATE TABLE IF NOT EXISTS rule_results ON CLUSTER 'gpuslo'
(
    evaluated_at DateTime('UTC'),
    window_s UInt32,
    rule LowCardinality(String),
    cluster LowCardinality(String),
    pool LowCardinality(String),
    label String,
    value Nullable(Float64)
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'rule_results_local', cityHash64(rule, window_s, cluster, pool, label));

CREATE TABLE IF NOT EXISTS alert_state_local ON CLUSTER 'gpuslo'
(
    fingerprint String,
    alertname LowCardinality(String),
    labels Map(String, String),
    annotations Map(String, String),
    state LowCardinality(String),
    started_at DateTime64(3, 'UTC'),
    ended_at Nullable(DateTime64(3, 'UTC')),
    last_sent_at DateTime64(3, 'UTC'),
    updated_at DateTime64(3, 'UTC')
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', updated_at)
ORDER BY fingerprint;

CREATE TABLE IF NOT EXISTS alert_state ON CLUSTER 'gpuslo'
(
    fingerprint String,
    alertname LowCardinality(String),
    labels Map(String, String),
    annotations Map(String, String),
    state LowCardinality(String),
    started_at DateTime64(3, 'UTC'),
    ended_at Nullable(DateTime64(3, 'UTC')),
    last_sent_at DateTime64(3, 'UTC'),
    updated_at DateTime64(3, 'UTC')
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'alert_state_local', cityHash64(fingerprint));

CREATE TABLE IF NOT EXISTS reclaim_actions_local ON CLUSTER 'gpuslo'
(
    at DateTime64(3, 'UTC'),
    cluster LowCardinality(String),
    scheduler LowCardinality(String),
    job String,
    holder_id String,
    queue LowCardinality(String),
    user LowCardinality(String),
    account LowCardinality(String),
    action LowCardinality(String),
    mode LowCardinality(String),
    outcome LowCardinality(String),
    reason String,
    attempt UInt16,
    held_since DateTime64(3, 'UTC'),
    idle_since DateTime64(3, 'UTC'),
    idle_gpu_hours Float64
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')
PARTITION BY toYYYYMM(at)
ORDER BY (cluster, holder_id, at)
TTL toDate(at) + INTERVAL 800 DAY;

CREATE TABLE IF NOT EXISTS reclaim_actions ON CLUSTER 'gpuslo'
(
    at DateTime64(3, 'UTC'),
    cluster LowCardinality(String),
    scheduler LowCardinality(String),
    job String,
    holder_id String,
    queue LowCardinality(String),
    user LowCardinality(String),
    account LowCardinality(String),
    action LowCardinality(String),
    mode LowCardinality(String),
    outcome LowCardinality(String),
    reason String,
    attempt UInt16,
    held_since DateTime64(3, 'UTC'),
    idle_since DateTime64(3, 'UTC'),
    idle_gpu_hours Float64
)
ENGINE = Distributed('gpuslo', currentDatabase(), 'reclaim_actions_local', cityHash64(cluster, holder_id));
