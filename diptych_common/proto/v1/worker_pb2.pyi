from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]
PRIORITY_INTERACTIVE: Priority
PRIORITY_BATCH: Priority

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed", "max_tokens", "ignore_eos", "tokens_already_generated", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "constraint")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ALREADY_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    max_tokens: int
    ignore_eos: bool
    tokens_already_generated: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    constraint: Constraint
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., tokens_already_generated: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "transfer_token", "priority", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    decode_address: str
    transfer_token: bytes
    priority: Priority
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., transfer_token: _Optional[bytes] = ..., priority: _Optional[_Union[Priority, str]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "kv_delivered")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    kv_delivered: KvDelivered
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., kv_delivered: _Optional[_Union[KvDelivered, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "cached_tokens", "compute_ms", "finished", "finished_by_eos", "logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_BY_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    cached_tokens: int
    compute_ms: int
    finished: bool
    finished_by_eos: bool
    logprobs: TokenLogprobs
    def __init__(self, token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., compute_ms: _Optional[int] = ..., finished: _Optional[bool] = ..., finished_by_eos: _Optional[bool] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ...) -> None: ...

class KvDelivered(_message.Message):
    __slots__ = ("kv_bytes", "transfer_ms", "data_path")
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    kv_bytes: int
    transfer_ms: int
    data_path: str
    def __init__(self, kv_bytes: _Optional[int] = ..., transfer_ms: _Optional[int] = ..., data_path: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "transfer_token", "sampling", "prompt_tokens", "priority", "cache_salt", "prompt_token_ids", "token_stream")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STREAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_token: bytes
    sampling: SamplingParams
    prompt_tokens: int
    priority: Priority
    cache_salt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_stream: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_token: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., cache_salt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_stream: _Optional[str] = ...) -> None: ...

class GenerateWork(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "cache_salt", "token_stream")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STREAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: Priority
    cache_salt: str
    token_stream: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ..., cache_salt: _Optional[str] = ..., token_stream: _Optional[str] = ...) -> None: ...

class TokenStreamRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[StreamedToken]
    def __init__(self, tokens: _Optional[_Iterable[_Union[StreamedToken, _Mapping]]] = ...) -> None: ...

class StreamedToken(_message.Message):
    __slots__ = ("request_id", "event")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    event: TokenEvent
    def __init__(self, request_id: _Optional[str] = ..., event: _Optional[_Union[TokenEvent, _Mapping]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_id", "finished", "finished_by_eos", "stats", "logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_BY_EOS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    finished: bool
    finished_by_eos: bool
    stats: PhaseStats
    logprobs: TokenLogprobs
    def __init__(self, token_id: _Optional[int] = ..., finished: _Optional[bool] = ..., finished_by_eos: _Optional[bool] = ..., stats: _Optional[_Union[PhaseStats, _Mapping]] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ...) -> None: ...

class PhaseStats(_message.Message):
    __slots__ = ("compute_ms", "cached_tokens")
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    compute_ms: int
    cached_tokens: int
    def __init__(self, compute_ms: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("worker_id", "queue_depth", "active_sequences", "kv_bytes_received", "kv_bytes_sent", "tokens_per_second", "kv_blocks_total", "kv_blocks_free", "block_size", "waiting_interactive", "waiting_batch", "draining", "prefix_cache", "prompt_tokens_pending", "speculative", "kv_tier", "prompt_tokens_computed", "tokens_generated", "kv_bytes_sent_by_path", "kv_bytes_received_by_path")
    class KvBytesSentByPathEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvBytesReceivedByPathEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WAITING_INTERACTIVE_FIELD_NUMBER: _ClassVar[int]
    WAITING_BATCH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PENDING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_BY_PATH_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_BY_PATH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    queue_depth: int
    active_sequences: int
    kv_bytes_received: int
    kv_bytes_sent: int
    tokens_per_second: float
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    waiting_interactive: int
    waiting_batch: int
    draining: bool
    prefix_cache: PrefixCacheSummary
    prompt_tokens_pending: int
    speculative: SpeculativeSummary
    kv_tier: KvTierSummary
    prompt_tokens_computed: int
    tokens_generated: int
    kv_bytes_sent_by_path: _containers.ScalarMap[str, int]
    kv_bytes_received_by_path: _containers.ScalarMap[str, int]
    def __init__(self, worker_id: _Optional[str] = ..., queue_depth: _Optional[int] = ..., active_sequences: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., block_size: _Optional[int] = ..., waiting_interactive: _Optional[int] = ..., waiting_batch: _Optional[int] = ..., draining: _Optional[bool] = ..., prefix_cache: _Optional[_Union[PrefixCacheSummary, _Mapping]] = ..., prompt_tokens_pending: _Optional[int] = ..., speculative: _Optional[_Union[SpeculativeSummary, _Mapping]] = ..., kv_tier: _Optional[_Union[KvTierSummary, _Mapping]] = ..., prompt_tokens_computed: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., kv_bytes_sent_by_path: _Optional[_Mapping[str, int]] = ..., kv_bytes_received_by_path: _Optional[_Mapping[str, int]] = ...) -> None: ...

class SpeculativeSummary(_message.Message):
    __slots__ = ("draft_tokens_proposed", "draft_tokens_accepted")
    DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    draft_tokens_proposed: int
    draft_tokens_accepted: int
    def __init__(self, draft_tokens_proposed: _Optional[int] = ..., draft_tokens_accepted: _Optional[int] = ...) -> None: ...

class KvTierSummary(_message.Message):
    __slots__ = ("hit_tokens", "queried_tokens", "blocks_put", "blocks_dropped", "errors")
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    hit_tokens: int
    queried_tokens: int
    blocks_put: int
    blocks_dropped: int
    errors: int
    def __init__(self, hit_tokens: _Optional[int] = ..., queried_tokens: _Optional[int] = ..., blocks_put: _Optional[int] = ..., blocks_dropped: _Optional[int] = ..., errors: _Optional[int] = ...) -> None: ...

class PrefixCacheSummary(_message.Message):
    __slots__ = ("version", "block_hashes", "hits_tokens", "queried_tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HITS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    hits_tokens: int
    queried_tokens: int
    def __init__(self, version: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., hits_tokens: _Optional[int] = ..., queried_tokens: _Optional[int] = ...) -> None: ...

class KvEndpointRequest(_message.Message):
    __slots__ = ("challenge",)
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    def __init__(self, challenge: _Optional[bytes] = ...) -> None: ...

class KvEndpoint(_message.Message):
    __slots__ = ("data_host", "data_port", "shm_probe_name", "shm_probe_nonce", "block_size", "dtype", "proof", "nixl")
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_NONCE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    data_host: str
    data_port: int
    shm_probe_name: str
    shm_probe_nonce: bytes
    block_size: int
    dtype: str
    proof: bytes
    nixl: bool
    def __init__(self, data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., shm_probe_name: _Optional[str] = ..., shm_probe_nonce: _Optional[bytes] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., proof: _Optional[bytes] = ..., nixl: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "lark_grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    lark_grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., lark_grammar: _Optional[str] = ...) -> None: ...
