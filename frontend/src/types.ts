// The shapes of the control plane's public REST API (see docs/sdk.md and /api/v1/schema/).

export interface Me {
  email: string | null;
  is_staff: boolean;
  organization: { id: string; name: string } | null;
  role: string | null;
}

export interface ListPage<T> {
  data: T[];
  has_more: boolean;
  total: number;
}

export interface DailyUsageRow {
  day: string; // YYYY-MM-DD
  key: string; // a phase, a model name or an API key id
  tokens: number;
  amount_micros: number;
}

export interface BillingCurrent {
  period_start: string;
  period_end: string;
  currency: string;
  amount_to_date_micros: number;
  projected_micros: number;
  spend_limit_micros: number | null;
  alerts: { threshold_percent: number; triggered_at: string }[];
}

// The open period's usage rated with the price book (GET /billing/current/costs).
export interface PeriodCosts {
  period_start: string;
  period_end: string; // exclusive
  currency: string;
  as_of: string | null;
  total_micros: number;
  phases: { phase: string; tokens: number; amount_micros: number }[];
  data: { day: string; model: string; phase: string; tier: string; tokens: number; amount_micros: number }[];
}

export interface InvoiceLine {
  model: string;
  phase: string;
  tier: string; // "standard", or "batch": Batch API requests at the batch price
  tokens: number;
  unit_price_micros_per_million: number;
  amount_micros: number;
}

export interface Invoice {
  id: string;
  period_start: string;
  period_end: string;
  status: string;
  currency: string;
  total_cents: number;
  lines: InvoiceLine[];
  stripe_invoice_id: string | null;
}

export interface ApiKey {
  id: string;
  name: string;
  prefix: string;
  scopes: string[];
  created_at: string;
  last_used_at: string | null;
  expires_at: string | null;
  revoked_at: string | null;
  limits: RateLimits;
  kind: "standard" | "batch_runner";
  key?: string;
}

// GET /auth/session: whether the browser is signed in, never an error.
export interface Session {
  signed_in: boolean;
  user: Me | null;
}

// GET /usage/requests: requests per day and key (an API key's id, a model or a tier).
export interface DailyRequestsRow {
  day: string;
  key: string;
  requests: number;
}

// GET /rate-limit-refusals: requests refused by one limit for one key on one day.
export interface RefusalRow {
  day: string;
  api_key_id: string;
  api_key_name: string;
  scope: "organization" | "api_key";
  limit: keyof RateLimits;
  limit_value: number;
  refusals: number;
  last_refused_at: string;
}

// Per-minute rate limits; null is unlimited.
export interface RateLimits {
  requests_per_minute: number | null;
  input_tokens_per_minute: number | null;
  output_tokens_per_minute: number | null;
}

export interface OrganizationLimits extends RateLimits {
  organization_id: string;
  spend_limit_micros: number | null;
}

export interface Fleet {
  name: string;
  role: string;
  model: string;
  region: string;
  hardware_class: string;
}

export interface Worker {
  id: string;
  name: string;
  fleet: string;
  role: string;
  model: string;
  region: string;
  address: string;
  state: string;
  queue_depth: number;
  active_sequences: number;
  kv_blocks_free: number;
  kv_blocks_total: number;
  tokens_per_second: number;
  last_heartbeat_at: string;
}

export interface Batch {
  id: string;
  status: string;
  endpoint: string;
  input_file_id: string;
  output_file_id: string | null;
  error_file_id: string | null;
  created_at: number; // seconds since the epoch
  request_counts: { total: number; completed: number; failed: number };
}

export interface BatchList {
  data: Batch[];
  has_more: boolean;
  last_id: string | null;
}

// GET /webhooks: an endpoint that receives the organization's events, signed with its secret.
export interface WebhookEndpoint {
  id: string;
  name: string;
  url: string;
  event_types: string[];
  signing_secret_hint: string;
  signing_secret?: string; // only in the answer to a create or a rotation
  created_at: number; // seconds since the epoch
}

// GET /webhooks/{id}/deliveries: one event on its way to the endpoint, with every try.
export interface WebhookDelivery {
  id: string;
  event_id: string;
  event_type: string;
  status: "pending" | "delivered" | "failed";
  created_at: string;
  next_attempt_at: string | null;
  attempts: { number: number; started_at: string; duration_ms: number; status_code: number | null; error: string }[];
}

export interface CursorList<T> {
  data: T[];
  has_more: boolean;
}
