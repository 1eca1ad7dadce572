"""Typed request and response bodies of the OpenAI-compatible API (msgspec Structs).

Requests reject values of the wrong type or out of range; Litestar turns the msgspec error into a
400 that names the field. Unknown top-level fields of a completion request are accepted (the service
logs them, or refuses them with ``strict_requests``). Fields Strata adds to OpenAI's (``top_k``,
``min_p``, ``repetition_penalty``) follow llama-server and vLLM.
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from strata_core.serving.sampling import MAX_LOGPROBS
from strata_core.serving.stop_strings import MAX_STOP_CHARS, MAX_STOPS

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
MaxTokens = Annotated[int, Meta(ge=1)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOPS)] | None
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # OpenAI's range (msgspec bounds are int64)
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]

#: fields clients commonly send that change nothing Strata computes: accepted, logged, ignored
IGNORED_FIELDS = ("store", "metadata", "service_tier", "prediction", "modalities", "id_slot", "timings_per_token")


class _Request(Struct, kw_only=True):
    """Fields shared by chat and text completions (unknown ones are decoded past: see ``unknown_fields``)."""

    model: str | None = None  # any name is served by the one model unless strict_model
    max_tokens: MaxTokens | None = None
    n_predict: MaxTokens | None = None  # llama-server's name for max_tokens
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    min_p: Probability = 0.0
    repetition_penalty: Annotated[float, Meta(ge=0.01, le=100.0)] = 1.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Bias] | None = None  # token id (as a string) -> added to its logit
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_prompt: bool = True  # llama-server: reuse a kept prefix (Strata always does; false is honoured as true)
    n: Annotated[int, Meta(ge=1)] = 1
    ignore_eos: bool = False  # llama-server, vLLM: run to max_tokens past end tokens (benchmarks)
    tools: list[Tool] | None = None  # chat only: rendered by the chat template
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most the first tool call of a reply is returned
    # constrained output (one of them): OpenAI's, and llama-server's GBNF grammar and JSON schema
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # not implemented: a value that would change the answer is a 400 naming the field
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # accepted and ignored (IGNORED_FIELDS)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[str] | None = None
    id_slot: int | None = None
    timings_per_token: bool | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def ignored(self) -> list[str]:
        """The IGNORED_FIELDS this request set."""
        return [name for name in IGNORED_FIELDS if getattr(self, name) is not None]


class FunctionDefinition(Struct, kw_only=True, omit_defaults=True):
    """A function tool, as the chat template receives it (fields left out are not passed)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Struct):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(Struct, kw_only=True):
    """A tool call of an assistant message, in a request or a reply."""

    function: FunctionCall
    id: str = ""  # a reply's is "call_" + hex; a request may leave it out
    type: Literal["function"] = "function"


class ToolCallDelta(Struct, kw_only=True):
    """One tool call in a streamed chunk, whole: ``index`` counts the reply's calls."""

    index: int
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ResponseFormat(Struct, kw_only=True):
    """OpenAI's output format: free text, any JSON object, or JSON valid for ``json_schema["schema"]``
    (``json_object`` with a ``schema``: llama-server's form of the latter)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    schema: dict[str, Any] | None = None


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning, as llama.cpp's server takes it
    tool_calls: list[ToolCall] | None = None  # an earlier reply's tool calls
    tool_call_id: str | None = None  # of a "tool" message: the call it answers

    def text(self) -> str:
        """The message's text, content parts joined."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    # OpenAI's field, as llama-server reads it: the chat template's reasoning_effort (gpt-oss's
    # "Reasoning: high"); "none" renders with enable_thinking false instead
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # the chat template's arguments, as vLLM and llama-server take them: no assistant header after the
    # messages, or the final (assistant) message continued instead of closed; other template variables
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | Annotated[list[str | int], Meta(min_length=1)]  # text, [text] or token ids
    max_tokens: MaxTokens | None = None  # 16 unless max_tokens or n_predict says otherwise
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None



class LlamaCompletionRequest(Struct, kw_only=True):
    """llama-server's native ``/completion`` body, generated as the text completion it maps to."""

    prompt: str | Annotated[list[int], Meta(min_length=1)]  # text or token ids
    n_predict: Annotated[int, Meta(ge=-1)] = -1  # -1 (or 0): the server's n_predict, else until the context is full
    temperature: Temperature = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    top_p: TopP = 1.0
    min_p: Probability = 0.0
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    n_probs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] = 0  # the top tokens of each step: completion_probabilities
    cache_prompt: bool = True  # as in _Request
    ignore_eos: bool = False
    repeat_penalty: Annotated[float, Meta(ge=0.01, le=100.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    grammar: str | None = None  # GBNF the output follows
    json_schema: dict[str, Any] | None = None  # a JSON schema the output follows
    # [[token id or text, bias], ...] or {"token id or text": bias}; a text biases each of its tokens,
    # false bans (read by GenerationService.llama_logit_bias)
    logit_bias: list[Any] | dict[str, Any] | None = None

    def completion_request(self, logit_bias: dict[str, float] | None = None) -> CompletionRequest:
        """The OpenAI text completion this request asks for (no max_tokens for an ``n_predict`` of -1 or 0),
        with ``logit_bias`` by token id."""
        return CompletionRequest(logit_bias=logit_bias,
            prompt=self.prompt, max_tokens=self.n_predict if self.n_predict > 0 else None,
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=self.seed,
            stop=self.stop, cache_prompt=self.cache_prompt, ignore_eos=self.ignore_eos,
            repetition_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=self.n_probs or None, grammar=self.grammar,
            json_schema=self.json_schema,
        )  # fmt: skip

    def params(self, default_n_predict: int | None, default_seed: int | None = None,
               logit_bias: dict[str, float] | None = None) -> LlamaParams:
        """This request's sampling settings as llama-server reports them; ``default_n_predict`` is the
        limit of a request that sets none (None: until the context is full, reported as -1),
        ``default_seed`` the seed of one that sets none, ``logit_bias`` its biases by token id."""
        n_predict = self.n_predict if self.n_predict > 0 else default_n_predict or -1
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        seed = self.seed if self.seed is not None else default_seed
        return LlamaParams(n_predict, seed, self.temperature, self.top_k, self.top_p, self.min_p,
                           self.repeat_penalty, self.presence_penalty, self.frequency_penalty, stops,
                           self.ignore_eos, self.n_probs,
                           [TokenBias(bias, int(token)) for token, bias in (logit_bias or {}).items()])

# --- responses ------------------------------------------------------------------------------------

#: the ``system_fingerprint`` of every completion object and chunk: the server's name and version
SYSTEM_FINGERPRINT = f"strata-{importlib.metadata.version('strata')}"


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ExpertUsage(Struct):
    """Expert-residency figures of one phase of a request."""

    hit_rate: float
    bytes_streamed: int
    link_gbps: float
    copy_ms: float
    compute_ms: float


class ExpertTimings(Struct):
    """Expert-residency figures of the prompt and of the decode windows a request took part in."""

    prompt: ExpertUsage
    decode: ExpertUsage


class Timings(Struct, kw_only=True):
    """llama-server's per-response timings (its ``draft_n`` / ``draft_n_accepted`` with speculative
    decoding), plus ``experts``."""

    prompt_n: int
    prompt_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    cache_n: int
    draft_n: int | msgspec.UnsetType = msgspec.UNSET
    draft_n_accepted: int | msgspec.UnsetType = msgspec.UNSET
    experts: ExpertTimings


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(Struct):
    content: str | None  # None: a reply of tool calls alone
    role: Literal["assistant"] = "assistant"
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET  # a harmony reply's analysis channel
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str = SYSTEM_FINGERPRINT


class ChatDelta(Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatRoleDelta(Struct):
    """The delta of a chat stream's first chunk: the role, and ``content`` null (as llama-server sends
    it; never ``""``)."""

    role: Literal["assistant"] = "assistant"
    content: None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta | ChatRoleDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct):
    """One server-sent event of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None = None
    # on the last chunks only (llama-server's clients read a chunk with the key as one that has them)
    timings: Timings | msgspec.UnsetType = msgspec.UNSET
    system_fingerprint: str = SYSTEM_FINGERPRINT


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct):
    """A text completion, or one server-sent event of a streamed one."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None = None
    timings: Timings | msgspec.UnsetType = msgspec.UNSET  # a stream's: on its last chunks only
    system_fingerprint: str = SYSTEM_FINGERPRINT


class Model(Struct):
    id: str
    created: int
    owned_by: str = "strata"
    object: Literal["model"] = "model"


class ModelList(Struct):
    data: list[Model]
    object: Literal["list"] = "list"


class Health(Struct):
    status: Literal["ok", "loading", "error"]
    slots_idle: int
    slots_processing: int
    requests_queued: int
    progress: float = 1.0  # of loading the model: 0 while it loads, 1 when it serves
    # why the server no longer serves: only with status "error" (llama-server's clients read a body
    # with an "error" key as a failure)
    error: str | msgspec.UnsetType = msgspec.UNSET


class TokenizeRequest(Struct, kw_only=True):
    """llama-server's ``/tokenize`` body."""

    content: str
    add_special: bool = False
    with_pieces: bool = False  # each token with its piece: TokenPieces


class Tokens(Struct):
    tokens: list[int]


class TokenPiece(Struct):
    id: int
    piece: str | list[int]  # the token's text, or its byte values where they are not whole UTF-8


class TokenPieces(Struct):
    """``/tokenize`` with ``with_pieces``."""

    tokens: list[TokenPiece]


class DetokenizeRequest(Struct):
    """llama-server's ``/detokenize`` body."""

    tokens: list[int]


class Content(Struct):
    content: str


class InputTokens(Struct):
    """``/chat/completions/input_tokens``: the tokens a chat request's prompt renders to."""

    input_tokens: int


class Prompt(Struct):
    """llama-server's ``/apply-template`` answer: the prompt text a chat request renders to."""

    prompt: str


class LlamaParams(Struct):
    """llama-server's sampling settings: a ``/completion``'s ``generation_settings``, and the defaults
    in ``/props``."""

    n_predict: int
    seed: int | None  # None: a random seed
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: list[str]
    ignore_eos: bool
    n_probs: int
    logit_bias: list[TokenBias] = msgspec.field(default_factory=list)  # the request's, by token id


class TokenBias(Struct):
    """One entry of ``generation_settings.logit_bias``, as llama-server lists them."""

    bias: float
    token: int


class TopTokenProbability(Struct):
    id: int
    token: str
    logprob: float
    bytes: list[int]


class TokenProbability(Struct):
    """One generated token in llama-server's ``completion_probabilities``."""

    id: int
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopTokenProbability]


class LlamaCompletionChunk(Struct):
    """One server-sent event of a streamed ``/completion`` before its last."""

    content: str
    stop: bool = False
    completion_probabilities: list[TokenProbability] | msgspec.UnsetType = msgspec.UNSET  # with n_probs


class LlamaCompletion(Struct):
    """llama-server's ``/completion`` answer, or the last event of its stream."""

    content: str
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    stop_type: Literal["eos", "limit", "word"]  # an end token, n_predict or the context, a stop string
    stopping_word: str
    timings: Timings
    generation_settings: LlamaParams
    stop: bool = True
    truncated: bool = False  # a prompt longer than the context is refused, never cut
    completion_probabilities: list[TokenProbability] | msgspec.UnsetType = msgspec.UNSET  # with n_probs


class GenerationSettings(Struct):
    n_ctx: int
    model: str
    params: LlamaParams  # what a request that sets none gets


class Props(Struct):
    """llama-server's ``/props``: the served model and its defaults."""

    default_generation_settings: GenerationSettings
    total_slots: int
    model_path: str
    model_alias: str
    chat_template: str


class SlotState(Struct):
    """One generation slot in llama-server's ``/slots``."""

    id: int
    is_processing: bool
    n_ctx: int
    n_tokens: int  # tokens its session holds (kept for prefix reuse when idle)
    n_prompt_tokens: int
    n_decoded: int


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None
    # llama-server's counts beside a prompt that does not fit the context
    n_prompt_tokens: int | msgspec.UnsetType = msgspec.UNSET
    n_ctx: int | msgspec.UnsetType = msgspec.UNSET


class ErrorBody(Struct):
    """The OpenAI error body."""

    error: ErrorDetail


def unknown_fields(body: bytes, struct: type[Struct]) -> list[str]:
    """The top-level keys of the JSON object ``body`` that ``struct`` has no field for, in body order
    (the values are not decoded)."""
    known = struct.__struct_encode_fields__
    return [key for key in msgspec.json.decode(body, type=dict[str, msgspec.Raw]) if key not in known]


def encode(value: Struct) -> bytes:
    """JSON bytes of a response struct."""
    return msgspec.json.encode(value)
