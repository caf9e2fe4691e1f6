-- POST one chat completion per request, each with a fresh X-Trajectory-Id.
--
--   wrk -s bench/wrk/chat.lua URL -- MODEL MODE TAG [API]
--
-- MODEL is the model name the target serves ("agent" for the proxies, the base
-- model's name for the upstream itself), MODE is "stream" or "plain", TAG a prefix
-- unique to this run: ids are TAG-<thread>-<n>, so no two requests share one.
-- API ("chat" by default, "responses", "messages") sends the same question to
-- /v1/responses or /v1/messages instead, in that API's grammar; "chat-as-proxied" sends
-- the chat body with the capture flags the proxy adds to it (return_token_ids, logprobs),
-- as the proxy forwards it (bench/_proxy/floor.py's relays pass it on unchanged).
-- done() prints one machine-readable line, BENCH_RESULT key=value ..., that
-- bench/proxy_overhead.py parses; "sent" counts request() calls, including requests
-- still in flight when wrk stopped (it runs one over per run: one call is never written).

local threads = {}
local next_thread = 1

function setup(thread)
   thread:set("thread_no", next_thread)
   next_thread = next_thread + 1
   table.insert(threads, thread)
end

function init(args)
   local model = args[1] or "agent"
   local stream = args[2] == "stream"
   local tag = args[3] or "bench"
   id_prefix = string.format("%s-%d-", tag, thread_no)
   sent = 0
   local api = args[4] or "chat"
   local question = "Write one short sentence about proxies, trajectories and rewards for this benchmark."
   local tail = stream and ',"stream":true' or ""
   if api == "responses" then
      body = string.format('{"model":"%s","input":"%s","max_output_tokens":16%s}', model, question, tail)
      path = "/v1/responses"
   elseif api == "messages" then
      body = string.format(
         '{"model":"%s","max_tokens":16,"messages":[{"role":"user","content":"%s"}]%s}', model, question, tail
      )
      path = "/v1/messages"
   else
      if api == "chat-as-proxied" then
         tail = tail .. ',"return_token_ids":true,"logprobs":true'
      end
      body = string.format(
         '{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":16%s}', model, question, tail
      )
      path = "/v1/chat/completions"
   end
end

function request()
   sent = sent + 1
   local headers = {
      ["Content-Type"] = "application/json",
      ["X-Trajectory-Id"] = id_prefix .. sent,
   }
   return wrk.format("POST", path, headers, body)
end

function done(summary, latency, requests)
   local sent_total = 0
   for _, thread in ipairs(threads) do
      sent_total = sent_total + thread:get("sent")
   end
   local e = summary.errors
   io.write(string.format(
      "BENCH_RESULT sent=%d completed=%d duration_us=%d connect=%d read=%d write=%d status=%d timeout=%d "
         .. "p50_us=%.0f p90_us=%.0f p99_us=%.0f mean_us=%.1f max_us=%.0f\n",
      sent_total, summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max
   ))
end
