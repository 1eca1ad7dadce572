"""``strata bench serve``: N concurrent streaming clients against a server, TTFT / ITL / tok/s."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from strata_core.cli.settings import ENGINE, SERVER, settings_with
from strata_core.errors import ConfigError

log = logging.getLogger(__name__)

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


class BenchServeCommand(settings_with(ENGINE, SERVER)):  # type: ignore[misc]
    """Load-test an OpenAI-compatible server: N closed-loop clients stream R requests and the report
    gives requests/s, output tok/s and TTFT / inter-token latency percentiles.

    With --url it drives that server (Strata, llama-server, vLLM, ...; --model-alias names the model
    requested, default the first of its /v1/models; --api-key is sent as the bearer token). Without
    --url it starts `strata serve` with the engine and server flags given here (--model, --devices,
    --parallel, ...) on a free port, waits until /health is 200, runs, and stops it.
    """

    url: str | None = Field(None, description="base URL of a running OpenAI-compatible server, e.g. "
                            "http://127.0.0.1:8080 (default: start strata serve)")
    clients: int = Field(4, ge=1, description="concurrent clients, each sending its next request when one ends")
    requests: int | None = Field(None, ge=1, description="requests in all (default: 2 x clients, or the lines "
                                 "of --input, repeated in turn to make up a larger --requests)")
    prompt_tokens: int = Field(1024, ge=1, description="prompt length: tokens where the server has /tokenize, "
                               "else words")
    output_tokens: int = Field(128, ge=1, description="max_tokens of each request")
    input_file: Path | None = Field(None, alias="input", description="JSONL of requests, one "
                                    "{\"prompt\": ..., \"max_tokens\": ...} a line (instead of synthetic prompts)")
    endpoint: Literal["completions", "chat"] = Field("completions", description="/v1/completions or "
                                                     "/v1/chat/completions")
    warmup: int = Field(1, ge=0, description="untimed requests before the run")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of every request (0 = greedy)")
    ignore_eos: bool = Field(False, description="send ignore_eos (llama-server, vLLM) so every request "
                             "generates max_tokens; Strata rejects the field")
    extra_body: str | None = Field(None, description="a JSON object merged into every request body, e.g. "
                                   "'{\"min_tokens\": 128}'")
    prompt_seed: int = Field(0, description="seed of the synthetic prompts' words")
    timeout: float = Field(600.0, gt=0, description="seconds one request may take")
    startup_timeout: float = Field(900.0, gt=0, description="seconds a started strata serve may take to load")
    progress: bool = Field(True, description="a progress bar on stderr (when it is a terminal)")
    json_file: Path | None = Field(None, alias="json", description="write the report as JSON here")

    def sampling(self) -> dict[str, Any]:
        """The fields every request carries besides the prompt and max_tokens."""
        fields: dict[str, Any] = {"temperature": self.temperature}
        if self.ignore_eos:
            fields["ignore_eos"] = True
        if self.extra_body:
            try:
                extra = json.loads(self.extra_body)
            except ValueError as error:
                raise ConfigError(f"--extra-body is not JSON: {error}") from None
            if not isinstance(extra, dict):
                raise ConfigError("--extra-body must be a JSON object")
            fields |= extra
        return fields

    def cli_cmd(self) -> None:
        """Run the load against --url or a strata serve of its own; print the tables (and the JSON)."""
        from strata_core.tools.bench_serve import LoadOptions, Target, base_url, bench
        from strata_core.tools.serve_launcher import free_port, strata_server
        from strata_core.tools.serve_report import format_report, report_json

        options = LoadOptions(clients=self.clients, requests=self.requests, prompt_tokens=self.prompt_tokens,
                              output_tokens=self.output_tokens, input_file=self.input_file, endpoint=self.endpoint,
                              warmup=self.warmup, sampling=self.sampling(), seed=self.prompt_seed,
                              timeout=self.timeout, progress=self.progress)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
        headers = {"Authorization": f"Bearer {self.api_key.get_secret_value()}"} if self.api_key else {}
        if self.url is not None:
            rep = bench(Target(base_url(self.url), self.model_alias or "", headers), options)
        else:
            settings = {name: getattr(self, name) for name in (*ENGINE, *SERVER)}
            host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
            settings |= {"host": host, "port": self.port if "port" in self.model_fields_set else free_port(host)}
            with strata_server(settings, self.startup_timeout) as url:
                rep = bench(Target(url, self.model_alias or "", headers), options)
            rep["setup"] |= {"server": "strata serve", "devices": ",".join(self.devices), "parallel": self.parallel,
                             "step_tokens": self.step_tokens, "strategy": self.strategy}
        print(format_report(rep))
        if self.json_file is not None:
            self.json_file.write_text(report_json(rep))
            log.info("bench serve report written to %s", self.json_file)
