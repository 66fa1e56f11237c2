"""Exception hierarchy for AstraFlow.

Every error AstraFlow raises on purpose derives from `AstraflowError`, so callers can catch the
family with one clause and library errors are wrapped (`raise SerdeError(...) from exc`) instead
of leaking. Each message says what went wrong and what the user can do about it.
"""

from __future__ import annotations


class AstraflowError(Exception):
    """Root of every error AstraFlow raises deliberately."""


class ConfigError(AstraflowError):
    """Raised when a config file, environment variable or override is invalid or unreadable."""


# --- local Kafka -------------------------------------------------------------------------------


class LocalKafkaError(AstraflowError):
    """Raised when the local Apache Kafka cannot be resolved, formatted, started or stopped."""


class ToolMissingError(LocalKafkaError):
    """Raised when a tool the local services need (Java, Maven; Go for the WAN proxy) is not on PATH."""


class WanError(LocalKafkaError):
    """Raised when the simulated WAN (Toxiproxy) cannot be built, started or configured."""


class LocalRegistryError(LocalKafkaError):
    """Raised when the local schema registry (Apicurio) cannot be resolved, started or stopped."""


class PortInUseError(LocalKafkaError):
    """Raised when the broker or controller port is already taken by another process."""


class ClusterIdMismatchError(LocalKafkaError):
    """Raised when the data directory was formatted for a different cluster id."""


# --- serde ------------------------------------------------------------------------------------


class SerdeError(AstraflowError):
    """Raised when a record cannot be encoded or decoded."""


class CorruptRecordError(SerdeError):
    """Raised when bytes are not a valid framed Avro record (bad magic, truncated, garbage)."""


class UnknownSchemaError(SerdeError):
    """Raised when a record's schema fingerprint or registry id matches no known schema."""


class IncompatibleSchemaError(UnknownSchemaError):
    """Raised when a record's writer schema is known (shipped, or served by the registry) but Avro
    schema resolution cannot turn it into the reader's version: the writer broke the record's
    compatibility rule. The message names the writer's and the reader's schema."""


class SchemaRegistryError(SerdeError):
    """Raised when the schema registry does not answer in time, or refuses to register a schema
    (its compatibility rule rejects it)."""


class SchemaValidationError(SerdeError):
    """Raised when a record does not conform to its schema (missing field, wrong type)."""


class RecordTooLargeError(SerdeError):
    """Raised when an encoded record exceeds the configured maximum message size."""


# --- Kafka layer -------------------------------------------------------------------------------


class KafkaLayerError(AstraflowError):
    """Raised when a Kafka operation (topic admin, produce, commit) fails."""


class ProduceError(KafkaLayerError):
    """Raised when the broker does not acknowledge a produced record."""


class TopicError(KafkaLayerError):
    """Raised when topics cannot be created or described."""


# --- models and RL math ------------------------------------------------------------------------


class ModelError(AstraflowError):
    """Raised when a local model or tokenizer cannot be built, loaded, fine-tuned or evaluated."""


class CalculatorError(AstraflowError):
    """Raised when the calculator tool refuses an expression (disallowed syntax, too long, too
    large) or cannot evaluate it (division by zero)."""


class RLError(AstraflowError):
    """Raised when RL math gets inputs it cannot use: mismatched shapes, an unknown aggregation
    mode, or invalid clip / cap settings."""


# --- weights (sparse delta codec) -------------------------------------------------------------


class WeightsError(AstraflowError):
    """Raised when weights cannot be encoded, decoded or applied (see the subclasses)."""


class DeltaFormatError(WeightsError):
    """Raised when bytes are not a valid weight delta or snapshot: bad magic, unknown format
    version or dtype, truncated stream, blocks out of order, or an unsupported tensor."""


class DeltaChecksumError(WeightsError):
    """Raised when a block, a tensor or a whole version does not match its recorded checksum
    after decoding: the delta was corrupted in transit; fetch a snapshot instead."""


class DeltaBaseMismatchError(WeightsError):
    """Raised when a delta is applied to weights other than the version it was encoded against
    (checksum, dtype or shape differ); fetch a snapshot or the delta for the right base."""


# --- dataflow strategies and sandbox -----------------------------------------------------------


class StrategyError(AstraflowError):
    """Raised when a data strategy (reward, filter, advantage, curator) cannot be registered,
    configured or applied: duplicate registration, wrong parameters, or inputs it cannot use."""


class UnknownStrategyError(StrategyError):
    """Raised when no strategy of that kind, name (and version) is registered; the message
    lists the known names and any plug-in that failed to load."""


class RewardError(StrategyError):
    """Raised when a trajectory cannot be scored: its reference JSON is missing or malformed
    for the reward in use (the record belongs in the DLQ, not a zero reward)."""


class SandboxError(AstraflowError):
    """Raised when the sandbox itself cannot run code (setup failed, isolation demanded but not
    available); what the untrusted code does is reported in the result, never raised."""


class SandboxUnavailableError(SandboxError):
    """Raised when the isolation the sandbox needs (bubblewrap with user namespaces, seccomp,
    cgroups) is missing here and the operator has not allowed weaker isolation; the message
    says what to install or which setting accepts the weaker mode."""
